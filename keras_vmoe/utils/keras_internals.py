"""The one place where keras_vmoe touches Keras internals.

Keras has no public API for the few things below; each function says why
keras_vmoe needs it. Keeping them here means a Keras upgrade that renames one
of them breaks one module, and `tests/utils/test_keras_internals.py` checks that
every attribute used here still exists in the installed Keras.

Checked against Keras 3.15.1 (`keras/src/backend/jax/trainer.py`): its
`predict` and `evaluate` detach the model's variable values
(`_purge_model_variables` sets `variable._value = None`) and reattach them
(`jax_state_sync`) only after the last batch, with no `try`/`finally`, so
a batch that raises leaves the model unusable
(`TypeError: 'NoneType' object is not callable` on the next call).
`models/state_guard.py` restores them with the functions below.
"""

import contextlib

# Attributes of Keras' JAX trainer that `state_guard` relies on (tested).
JAX_TRAINER_METHODS = ("jax_state_sync", "_purge_model_variables", "_get_jax_state")
JAX_TRAINER_STATE = ("_jax_state", "_jax_state_synced")


# -- variables detached by the JAX trainer ------------------------------------


def variable_value(variable):
    """The value attached to `variable`, or None while the JAX trainer holds it.

    `variable.value` raises (or returns None) while detached; the raw
    `_value` slot is the only way to tell.
    """
    return getattr(variable, "_value", None)


def reattach_value(variable, value):
    """Writes `value` back into a variable that the JAX trainer left detached.

    `variable.assign` cannot be used: it reads the (missing) current value.
    """
    variable._value = value


def has_pending_jax_state(model):
    """Whether the JAX trainer holds variable values not yet written back."""
    return bool(getattr(model, "_jax_state", None)) and not getattr(
        model, "_jax_state_synced", True
    )


def sync_jax_state(model):
    """Writes the JAX trainer's detached variable values back into the model.

    `jax_state_sync` is the JAX trainer's hook for callbacks; it does not
    exist on the other backends, which update the variables in place.
    """
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def clear_jax_state(model):
    """Forgets the JAX trainer's loop state (as its loops do when they end)."""
    model._jax_state = None
    model._jax_state_synced = True


# -- layers and building ------------------------------------------------------


def flatten_layers(model):
    """Every layer of `model`, nested ones included (`Layer._flatten_layers`).

    The public `model.layers` lists only the direct children.
    """
    return model._flatten_layers()


def retrack_variables(model):
    """Re-lists each layer's variables after quantization replaced some.

    What `Model._post_quantize` does on torch: the removed float kernels are
    otherwise still referenced by the torch parameter list (and never freed).
    """
    for layer in model._flatten_layers():
        layer._track_variables()


def symbolic_build(model, batch):
    """Builds what `fit` needs (model, metrics, optimizer) from one batch.

    `Trainer._symbolic_build` is what `fit` itself calls; there is no public
    equivalent.
    """
    model._symbolic_build(data_batch=batch)


def set_variable_layout(variable, layout):
    """Sets the distribution layout of a variable that skipped initialization.

    Keras sets `variable._layout` when it initializes a variable; abstract
    variables (`keras_vmoe.models.configs.abstract_weights`) skip that.
    """
    variable._layout = layout


# Methods of `keras.Variable` that `utils.initialization` wraps (tested).
VARIABLE_METHODS = ("_initialize_with_initializer", "_initialize", "_convert_to_tensor",
                    "assign", "_direct_assign")
# The samplers of Keras' backend random module that its initializers call
# (tested).
BACKEND_SAMPLERS = ("normal", "truncated_normal", "uniform")
# The functions of Keras' saving library that build a model from a `.keras`
# file and load its weights, and its guarded reader of an archive member
# (tested).
KERAS_FILE_LOADERS = ("_load_model_from_fileobj", "_load_model_from_dir")
KERAS_ZIP_READER = "_safe_zip_read"


def initialize_variable(variable, value):
    """Gives a variable being created `value` instead of its initializer's draw.

    `Variable._initialize_with_initializer` is where each backend's variable
    (JAX array with its layout, `tf.Variable`, torch `Parameter`) runs its
    initializer; `_initialize` is the same step from a value, as Keras does
    for a variable created from an array. No public API creates a variable
    whose initializer is skipped.

    On JAX a host (numpy) `value` is handed over without a copy
    (`jax.device_put(..., may_alias=True)`): Keras' own conversion copies
    it, and for placeholder zeros of a whole model that copy costs as much
    memory and time as the weights loaded into them next. The other
    backends copy it into their own variable (`tf.Variable`, torch
    `Parameter`).
    """
    import keras

    if keras.backend.backend() == "jax":
        import jax

        variable._initialize(jax.device_put(value, may_alias=True))
        return
    variable._initialize(variable._convert_to_tensor(value, dtype=variable.dtype))


def replace_initial_value(variable, value):
    """Replaces the value a variable was created with (not an assignment).

    `utils.initialization.batched_initializers` creates variables with
    zeros, then gives them the values drawn for all of them at once.
    `variable.assign` would count as the assignment of a loaded weight;
    `_direct_assign` is the step of `_initialize` that stores the value.
    """
    variable._direct_assign(value)


def variable_layout(variable):
    """The distribution layout of a variable being created, or None.

    Keras draws the initial value of a variable with a layout inside its
    own jitted program (sharded at creation); there is no public getter.
    """
    return getattr(variable, "_layout", None)


def initializer_random_module():
    """The backend random module whose samplers Keras' initializers call.

    `keras.initializers.RandomNormal`, `TruncatedNormal`, `RandomUniform`
    and `VarianceScaling` return `random.<sampler>(shape, ..., seed=...)`
    of this module (`keras.src.backend.random`) directly; recording those
    calls gives the exact draw an initializer makes without making it.
    """
    from keras.src.initializers import random_initializers

    return random_initializers.random


def patch_keras_file_loaders(wrap):
    """Wraps the two functions of Keras' saving library that build a model
    from a `.keras` file (or folder) and load its weights; returns the undo.

    `keras.saving.load_model` (and unpickling a model) builds the model from
    its config, drawing every weight, then overwrites them all; no public
    hook runs around both steps. `wrap(load, read_config)` gets each
    loader and the function reading the model config of its first
    argument (with Keras' own guard against an oversized member).
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
    """Lets `read(dataset)` read the datasets of Keras' `.weights.h5` store.

    `read` returns an array, or None for Keras' own read (`np.array`).
    Keras reads each weight into a fresh NumPy array, which the JAX backend
    then copies; no public API lets a caller say where the values go.
    Returns the function that restores Keras' read.
    """
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
    """Replaces methods of the backend's `keras.Variable` class; returns the undo.

    `utils.initialization.skip_initializers` needs every variable Keras
    creates (in any layer, through `add_weight` or not) to skip its
    initializer, and every assignment to be seen; the backend's variable
    class is the one place all of them pass through.
    """
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


# -- scopes -------------------------------------------------------------------


def stateless_scope():
    """The active `keras.StatelessScope`, or None (no public getter)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


@contextlib.contextmanager
def no_autocast():
    """Variables read inside the block give their stored dtype.

    A layer running a mixed policy (e.g. `"mixed_bfloat16"`) casts every
    float variable it reads to its compute dtype; `models.remat` needs the
    stored values to hand them to a recomputed call. Keras' `AutocastScope`
    with dtype None is the only way to switch the cast off (no public API).
    """
    from keras.src.backend.common.variables import AutocastScope

    with AutocastScope(None):
        yield


def forget_sublayer_losses(layer):
    """Forgets the `add_loss` losses that the sublayers of `layer` hold.

    A layer remembers the ids of the losses it added in a
    `StatelessScope`; `models.remat` collects its sublayers' losses from
    its own scope and adds them again, once, from `layer`, so the old ids
    (of objects that may be freed and their ids reused) must go.
    `Layer._clear_losses` is what `Layer.__call__` itself runs; there is no
    public equivalent.
    """
    for sublayer in layer._layers:
        sublayer._clear_losses()


@contextlib.contextmanager
def keep_uninitialized_variables():
    """Restores Keras' global list of pending variable initializations on exit.

    Variables created in `StatelessScope(initialize_variables=False)` are
    queued in a global list that Keras would initialize later; the abstract
    builds of `abstract_weights` must leave that list as they found it.
    """
    from keras.src.backend.common import global_state

    key = "uninitialized_variables"
    pending = list(global_state.get_global_attribute(key) or [])
    try:
        yield
    finally:
        global_state.set_global_attribute(key, pending)


# -- saving -------------------------------------------------------------------


def saving_lib():
    """Keras' `saving_lib` module, or None if this Keras lacks what we use.

    Keras has no public API for the weights-file layout of a model;
    `presets.integrity` reuses the walk of `save_weights` (`_save_state`)
    with an `H5IOStore` subclass that records shapes.
    """
    try:
        from keras.src.saving import saving_lib as lib

        lib._save_state  # noqa: B018 - fail here if it is gone.
        lib.H5IOStore  # noqa: B018
    except (ImportError, AttributeError):
        return None
    return lib


# -- layers that add or replace weights after build ---------------------------


@contextlib.contextmanager
def tracking_unlocked(layer):
    """Lets a built layer add weights (LoRA factors, int8 kernels).

    Keras locks a layer's tracker after `build`; its own `enable_lora` and
    `quantize` unlock it through the private `_tracker`, with no public way.
    """
    layer._tracker.unlock()
    try:
        yield
    finally:
        layer._tracker.lock()


@contextlib.contextmanager
def collect_garbage_once():
    """Runs one `gc.collect()` at the end of the block instead of one per
    deleted variable.

    Keras' `Layer.__delattr__` runs a full `gc.collect()` for every variable
    it deletes, and `quantize` deletes each float kernel it replaces. A full
    collection walks every live object (all of TensorFlow's, where a process
    imported it), so quantizing a model cost a collection per layer. Keras
    imports `gc` inside that method, so only the module attribute can be
    swapped. Nested blocks collect once, at the outermost end.
    """
    import gc

    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect
        collect()


def check_quantize_args(layer, mode, compute_dtype):
    """Keras' own checks of `layer.quantize(mode)` (private, no public API)."""
    layer._check_quantize_args(mode, compute_dtype)


def distribution_layout_map(distribution):
    """The `LayoutMap` of a `ModelParallel` distribution, or None.

    `keras.distribution.ModelParallel` keeps it private (`_layout_map`) and
    has no getter.
    """
    return getattr(distribution, "_layout_map", None)


# -- functional graphs --------------------------------------------------------


def run_functional_graph(model, inputs, training, replacements):
    """`model.call(inputs, training)` with some operations of its graph replaced.

    What `Functional.call` does (`_standardize_inputs`, `_run_through_graph`
    with the call-context arguments injected), except that an operation
    whose id is in `replacements` runs `replacements[id(op)](x, training)`
    instead. `models.scan` runs a segment of encoder blocks as one scan this
    way while the backbone keeps its graph (summary, feature models).
    Keras has no public hook into a functional model's graph execution.

    Args:
        model: a functional `keras.Model` with one input.
        inputs: the model's input tensor.
        training: the `training` argument of the call (may be None).
        replacements: dict `{id(operation): callable(x, training)}`.

    Returns:
        The model's outputs.
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
    """`keras.utils.set_random_seed(seed)`, without importing TensorFlow.

    Keras' function imports TensorFlow wherever it is installed, to seed it
    for `tf.data` shuffling: seconds of start-up in a process that has no
    other use for it. Here TensorFlow is seeded only when it is already
    imported (Keras' lazy `tf` module in `rng_utils` reads as unavailable
    otherwise); Python, NumPy, Keras' global seed generator and PyTorch are
    seeded as by Keras.

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
