"""The one place where keras_vmoe touches Keras internals (no public API).

`tests/utils/test_keras_internals.py` checks that every attribute used here
still exists in the installed Keras.
"""

import contextlib

# Attributes of Keras' JAX trainer that `state_guard` relies on (tested).
JAX_TRAINER_METHODS = ("jax_state_sync", "_purge_model_variables", "_get_jax_state")
JAX_TRAINER_STATE = ("_jax_state", "_jax_state_synced")


def variable_value(variable):
    """The value attached to `variable`, or None while the JAX trainer holds it."""
    return getattr(variable, "_value", None)


def reattach_value(variable, value):
    """Writes `value` back into a variable the JAX trainer left detached
    (`assign` would read the missing current value)."""
    variable._value = value


def has_pending_jax_state(model):
    """Whether the JAX trainer holds variable values not yet written back."""
    return bool(getattr(model, "_jax_state", None)) and not getattr(
        model, "_jax_state_synced", True
    )


def sync_jax_state(model):
    """Writes the JAX trainer's detached variable values back (JAX only)."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def clear_jax_state(model):
    """Forgets the JAX trainer's loop state (as its loops do when they end)."""
    model._jax_state = None
    model._jax_state_synced = True


def flatten_layers(model):
    """Every layer of `model`, nested ones included (`Layer._flatten_layers`)."""
    return model._flatten_layers()


def retrack_variables(model):
    """Re-lists each layer's variables after quantization replaced some (as
    `Model._post_quantize` does on torch, so the old kernels are freed)."""
    for layer in model._flatten_layers():
        layer._track_variables()


def symbolic_build(model, batch):
    """Builds what `fit` needs (model, metrics, optimizer) from one batch."""
    model._symbolic_build(data_batch=batch)


def set_variable_layout(variable, layout):
    """Sets the distribution layout of a variable that skipped initialization."""
    variable._layout = layout


# Methods of `keras.Variable` that `utils.initialization` wraps (tested).
VARIABLE_METHODS = ("_initialize_with_initializer", "_initialize", "_convert_to_tensor",
                    "assign", "_direct_assign")
# The samplers of Keras' backend random module its initializers call (tested).
BACKEND_SAMPLERS = ("normal", "truncated_normal", "uniform")
# Keras' `.keras` loaders and its guarded archive-member reader (tested).
KERAS_FILE_LOADERS = ("_load_model_from_fileobj", "_load_model_from_dir")
KERAS_ZIP_READER = "_safe_zip_read"


def initialize_variable(variable, value):
    """Gives a variable being created `value` instead of its initializer's draw.

    On JAX a host `value` is aliased (`device_put(may_alias=True)`), not
    copied as Keras' conversion would; other backends copy it.
    """
    import keras

    if keras.backend.backend() == "jax":
        import jax

        variable._initialize(jax.device_put(value, may_alias=True))
        return
    variable._initialize(variable._convert_to_tensor(value, dtype=variable.dtype))


def replace_initial_value(variable, value):
    """Replaces the value a variable was created with (`assign` would count
    as loading a weight)."""
    variable._direct_assign(value)


def variable_layout(variable):
    """The distribution layout of a variable being created, or None."""
    return getattr(variable, "_layout", None)


def initializer_random_module():
    """The backend random module whose samplers Keras' initializers call."""
    from keras.src.initializers import random_initializers

    return random_initializers.random


def patch_keras_file_loaders(wrap):
    """Wraps Keras' `.keras` file and folder loaders; returns the undo.

    `wrap(load, read_config)` gets each loader and a function reading the
    model config of its first argument.
    """
    import json
    import os
    import zipfile

    from keras.src.saving import saving_lib

    def from_file(fileobj):
        position = fileobj.tell()
        try:
            with zipfile.ZipFile(fileobj, "r") as archive:
                read = getattr(saving_lib, KERAS_ZIP_READER)
                return json.loads(read(archive, "config.json"))
        finally:
            fileobj.seek(position)

    def from_dir(path):
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)

    saved = {name: getattr(saving_lib, name) for name in KERAS_FILE_LOADERS}
    saving_lib._load_model_from_fileobj = wrap(saved["_load_model_from_fileobj"], from_file)
    saving_lib._load_model_from_dir = wrap(saved["_load_model_from_dir"], from_dir)

    def restore():
        for name, function in saved.items():
            setattr(saving_lib, name, function)

    return restore


def patch_h5_reads(read):
    """Lets `read(dataset)` (an array, or None for Keras' own read) read the
    datasets of Keras' `.weights.h5` store; returns the undo."""
    from keras.src.saving import saving_lib

    original = saving_lib.safe_get_h5_dataset

    def get(group, name):
        dataset = original(group, name)
        value = read(dataset)
        return dataset if value is None else value

    saving_lib.safe_get_h5_dataset = get

    def restore():
        saving_lib.safe_get_h5_dataset = original

    return restore


def patch_variable_methods(**methods):
    """Replaces methods of the backend's `keras.Variable` class; returns the undo."""
    import keras

    cls = keras.Variable
    saved = {name: cls.__dict__.get(name) for name in methods}
    for name, method in methods.items():
        setattr(cls, name, method)

    def restore():
        for name, method in saved.items():
            if method is None:
                delattr(cls, name)
            else:
                setattr(cls, name, method)

    return restore


def stateless_scope():
    """The active `keras.StatelessScope`, or None (no public getter)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


@contextlib.contextmanager
def no_autocast():
    """Variables read inside the block give their stored dtype (no autocast)."""
    from keras.src.backend.common.variables import AutocastScope

    with AutocastScope(None):
        yield


def forget_sublayer_losses(layer):
    """Forgets the `add_loss` losses that the sublayers of `layer` hold
    (`models.remat` adds them again from `layer`)."""
    for sublayer in layer._layers:
        sublayer._clear_losses()


@contextlib.contextmanager
def keep_uninitialized_variables():
    """Restores Keras' global list of pending variable initializations on exit."""
    from keras.src.backend.common import global_state

    key = "uninitialized_variables"
    pending = list(global_state.get_global_attribute(key) or [])
    try:
        yield
    finally:
        global_state.set_global_attribute(key, pending)


def saving_lib():
    """Keras' `saving_lib` module, or None if this Keras lacks what we use."""
    try:
        from keras.src.saving import saving_lib as lib

        lib._save_state  # noqa: B018 - fail here if it is gone.
        lib.H5IOStore  # noqa: B018
    except (ImportError, AttributeError):
        return None
    return lib


@contextlib.contextmanager
def tracking_unlocked(layer):
    """Lets a built layer add weights (LoRA factors, int8 kernels)."""
    layer._tracker.unlock()
    try:
        yield
    finally:
        layer._tracker.lock()


@contextlib.contextmanager
def collect_garbage_once():
    """Runs one `gc.collect()` at the end of the block instead of the one
    Keras' `Layer.__delattr__` runs per deleted variable."""
    import gc

    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect
        collect()


def check_quantize_args(layer, mode, compute_dtype):
    """Keras' own checks of `layer.quantize(mode)`."""
    layer._check_quantize_args(mode, compute_dtype)


def distribution_layout_map(distribution):
    """The `LayoutMap` of a `ModelParallel` distribution, or None."""
    return getattr(distribution, "_layout_map", None)


def run_functional_graph(model, inputs, training, replacements):
    """`model.call(inputs, training)` with some operations of its graph replaced.

    `model` is functional with one input; an operation whose id is in
    `replacements` runs `replacements[id(op)](x, training)` instead.
    """
    from keras.src.models.functional import operation_fn
    from keras.src.models.functional import unpack_singleton

    inputs = model._standardize_inputs(inputs)

    def wrap(operation):
        replacement = replacements.get(id(operation))
        if replacement is None:
            return operation_fn(operation, training=training)
        return lambda x, **kwargs: replacement(x, training)

    outputs = model._run_through_graph(inputs, operation_fn=wrap)
    return unpack_singleton(outputs)


class _TensorFlowNotImported:
    available = False


def set_random_seed(seed):
    """`keras.utils.set_random_seed(seed)`, seeding TensorFlow only when it is
    already imported (Keras' function would import it).

    Args:
        seed: int.
    """
    import sys

    import keras
    from keras.src.utils import rng_utils

    if sys.modules.get("tensorflow") is not None:
        keras.utils.set_random_seed(seed)
        return
    lazy = rng_utils.tf
    rng_utils.tf = _TensorFlowNotImported()
    try:
        keras.utils.set_random_seed(seed)
    finally:
        rng_utils.tf = lazy
