"""A shared test base for keras_vmoe's layers, backbones, tasks and presets.

In the spirit of KerasHub's `TestCase`: one function per kind of object
runs the checks every public class must pass, so that a class test is a
few lines. Import with `import testing` (tests/conftest.py puts this folder
on `sys.path`).

- `run_layer_test`: build and call, output shape, `get_config` /
  `from_config` round trip (through JSON), a jitted call equal to the eager
  one, mixed precision, optionally `.keras` saving (a model comes back as
  the same class with the same config and outputs).
- `run_backbone_test`: the layer checks, plus int8 quantization and LoRA.
- `run_task_test`: the backbone checks on a task, plus one `fit` step (and
  the trained model's `.keras` file keeps its optimizer step).
- `run_preset_test`: `Class.from_preset` returns `Class` with the expected
  output shape.
"""

import contextlib
import json
import signal

import keras
import numpy as np

from keras_vmoe.presets import resolve_preset_name
from keras_vmoe.utils.keras_internals import flatten_layers

ATOL = 1e-5
# Rounding to bfloat16 around the expert dispatch turns a one-ulp float32
# difference (XLA fuses a jitted call differently from eager ops) into a
# one-ulp bfloat16 difference (2**-8 relative) in a few expert inputs.
BFLOAT16_DISPATCH_ATOL = 2e-3


def _to_numpy(value):
    return keras.tree.map_structure(lambda v: np.asarray(keras.ops.convert_to_numpy(v)),
                                    value)


def _shapes(value):
    return keras.tree.map_structure(lambda v: tuple(v.shape), value)


def jit_call(layer, *args, **kwargs):
    """Calls a built layer under `jax.jit` (a stateless run); eager elsewhere."""
    if keras.backend.backend() != "jax":
        return layer(*args, **kwargs)
    import jax

    variables = list(layer.variables)

    def run(values, *inputs):
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return layer(*inputs, **kwargs)

    return jax.jit(run)([v.value for v in variables], *args)


class _JitOutput:
    """`output_fn(layer(...))`, with the layer's variables (for `jit_call`)."""

    def __init__(self, layer, output_fn):
        self.layer = layer
        self.output_fn = output_fn
        self.variables = layer.variables

    def __call__(self, *args, **kwargs):
        return self.output_fn(self.layer(*args, **kwargs))


def _round_trip(obj):
    """`obj` rebuilt from its serialized config, through JSON."""
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(obj)))
    return keras.saving.deserialize_keras_object(config)


def _json(config):
    """A config as a saved file holds it (tuples become lists)."""
    return json.loads(json.dumps(config))


def _check_config_round_trip(obj):
    restored = type(obj).from_config(obj.get_config())
    assert _json(restored.get_config()) == _json(obj.get_config())
    restored = _round_trip(obj)
    assert type(restored) is type(obj)
    assert _json(restored.get_config()) == _json(obj.get_config())
    return restored


def assert_close(actual, expected, atol=ATOL):
    """`np.testing.assert_allclose` over matching structures of arrays."""
    actual, expected = _to_numpy(actual), _to_numpy(expected)
    keras.tree.assert_same_structure(actual, expected)
    for a, e in zip(keras.tree.flatten(actual), keras.tree.flatten(expected),
                    strict=True):
        np.testing.assert_allclose(a, e, atol=atol)


def _rounds_to_bfloat16(layer):
    """Whether any layer inside `layer` rounds its dispatch to bfloat16."""
    return any(getattr(sublayer, "bfloat16_dispatch", False)
               for sublayer in flatten_layers(layer))


def _identity(value):
    return value


def _check_same_output(restored, obj, input_data, call_kwargs, output_fn=_identity):
    restored(input_data, **call_kwargs)  # builds the weights
    restored.set_weights(obj.get_weights())
    assert_close(
        output_fn(restored(input_data, **call_kwargs)),
        output_fn(obj(input_data, **call_kwargs)),
    )


def _check_saving(obj, input_data, call_kwargs, tmp_path):
    path = str(tmp_path / f"{obj.name}.keras")
    if isinstance(obj, keras.Model):
        obj.save(path)
    else:
        keras.Sequential([keras.Input(np.shape(input_data)[1:]), obj]).save(path)
    loaded = keras.saving.load_model(path)
    if isinstance(obj, keras.Model):
        assert type(loaded) is type(obj)
        assert _json(loaded.get_config()) == _json(obj.get_config())
    else:
        loaded = loaded.layers[-1]
    assert_close(loaded(input_data, **call_kwargs), obj(input_data, **call_kwargs))
    return loaded


def _check_mixed_precision(cls, init_kwargs, input_data, call_kwargs, output_fn):
    layer = cls(**{**init_kwargs, "dtype": "mixed_bfloat16"})
    output = output_fn(layer(input_data, **call_kwargs))
    for value in keras.tree.flatten(output):
        assert keras.backend.standardize_dtype(value.dtype) in ("bfloat16", "float32")
        assert np.all(np.isfinite(np.asarray(keras.ops.convert_to_numpy(
            keras.ops.cast(value, "float32")))))
    for variable in layer.trainable_weights:
        assert keras.backend.standardize_dtype(variable.dtype) == "float32"
    return layer


def run_layer_test(
    cls,
    init_kwargs,
    input_data,
    expected_output_shape,
    call_kwargs=None,
    run_jit=True,
    run_mixed_precision=True,
    run_saving=False,
    tmp_path=None,
    output_fn=None,
):
    """Runs the checks every public layer passes.

    Args:
        cls: the layer class.
        init_kwargs: constructor arguments.
        input_data: an input array (or structure).
        expected_output_shape: shape (or structure of shapes) of the output.
        call_kwargs: extra call arguments (e.g. `training=False`).
        run_jit: check that a jitted call equals the eager call.
        run_mixed_precision: build with `dtype="mixed_bfloat16"`: float32
            weights, finite bfloat16/float32 outputs.
        run_saving: save to and load from a `.keras` file (needs `tmp_path`).
        tmp_path: a directory for `run_saving`.
        output_fn: maps a call's result to the arrays to check (e.g. the
            tensors of a router's `Routing`).

    Returns:
        The layer built from `init_kwargs`.
    """
    call_kwargs = dict(call_kwargs or {})
    output_fn = output_fn or _identity
    # The same weights whichever tests ran before on this worker (the int8
    # check's tolerance holds for these weights, not for every draw).
    keras.utils.set_random_seed(0)
    layer = cls(**init_kwargs)
    output = output_fn(layer(input_data, **call_kwargs))
    assert _shapes(output) == expected_output_shape
    restored = _check_config_round_trip(layer)
    _check_same_output(restored, layer, input_data, call_kwargs, output_fn)
    if run_jit:
        jitted = _JitOutput(layer, output_fn)
        atol = BFLOAT16_DISPATCH_ATOL if _rounds_to_bfloat16(layer) else ATOL
        assert_close(jit_call(jitted, input_data, **call_kwargs), output, atol=atol)
    if run_mixed_precision:
        _check_mixed_precision(cls, init_kwargs, input_data, call_kwargs, output_fn)
    if run_saving:
        _check_saving(layer, input_data, call_kwargs, tmp_path)
    return layer


def _check_preset_round_trip(model, input_data, tmp_path):
    """`model.save_to_preset` then `type(model).from_preset`: same class, same
    outputs (the bases' class-owned saving)."""
    path = model.save_to_preset(tmp_path / f"{model.name}_preset")
    loaded = type(model).from_preset(path)
    assert type(loaded) is type(model)
    assert_close(loaded(input_data), model(input_data))


def _check_int8(model, input_data, make_quantizable=None):
    """int8 weights give outputs close to the float model's."""
    quantizable = make_quantizable(model) if make_quantizable else model
    expected = _to_numpy(quantizable(input_data))
    quantizable.quantize("int8")
    actual = _to_numpy(quantizable(input_data))
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, atol=0.1 * scale)


def _check_lora(model, input_data):
    """LoRA keeps the outputs (zero-initialised B) and trains fewer weights."""
    before = _to_numpy(model(input_data))
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    model.enable_lora(2)
    np.testing.assert_allclose(_to_numpy(model(input_data)), before, atol=ATOL)
    after = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    assert 0 < after < trainable


def run_backbone_test(
    cls,
    init_kwargs,
    input_data,
    expected_output_shape,
    run_quantization=True,
    run_lora=True,
    run_saving=False,
    tmp_path=None,
):
    """The layer checks on a backbone, plus int8 quantization and LoRA.

    int8 and LoRA run on fresh copies (they change the model). With
    `run_saving`, also a `.keras` file and `save_to_preset`/`from_preset`.

    Returns:
        The backbone built from `init_kwargs`.
    """
    backbone = run_layer_test(
        cls, init_kwargs, input_data, expected_output_shape,
        run_saving=run_saving, tmp_path=tmp_path,
    )
    if run_saving:
        _check_preset_round_trip(backbone, input_data, tmp_path)
    if run_quantization:
        copy = cls.from_config(backbone.get_config())
        copy.set_weights(backbone.get_weights())
        _check_int8(copy, input_data)
    if run_lora:
        copy = cls.from_config(backbone.get_config())
        copy.set_weights(backbone.get_weights())
        _check_lora(copy, input_data)
    return backbone


def run_task_test(
    cls,
    init_kwargs,
    train_data,
    expected_output_shape,
    run_fit=True,
    run_quantization=True,
    run_lora=True,
    run_mixed_precision=True,
    run_saving=False,
    tmp_path=None,
):
    """The checks every task passes.

    Args:
        cls: the task class.
        init_kwargs: constructor arguments; `backbone` is a backbone
            instance (copied for the checks that change the model).
        train_data: `(images, labels)`.
        expected_output_shape: shape of `task(images)`.
        run_fit: one `fit` step on `train_data` with the default compile.
        run_saving: a `.keras` file (of the trained copy with `run_fit`:
            same class, config, outputs and optimizer step) and
            `save_to_preset`/`from_preset` (needs `tmp_path`).

    Returns:
        The task built from `init_kwargs`.
    """
    images, labels = train_data
    task = cls(**init_kwargs)
    assert tuple(task(images).shape) == expected_output_shape
    # An unbuilt layer (one the call does not reach) makes every `fit` and
    # `train_on_batch` re-trace the model to build it.
    assert [layer.name for layer in task._flatten_layers() if not layer.built] == []
    restored = _check_config_round_trip(task)
    _check_same_output(restored, task, images, {})

    def fresh():
        copy = cls.from_config(task.get_config())
        copy.set_weights(task.get_weights())
        return copy

    if run_mixed_precision:
        backbone = init_kwargs["backbone"]
        mixed = type(backbone)(**{**backbone.get_config(), "dtype": "mixed_bfloat16"})
        mixed_task = cls(**{**init_kwargs, "backbone": mixed})
        output = mixed_task(images)
        output = keras.ops.convert_to_numpy(keras.ops.cast(output, "float32"))
        assert output.shape == expected_output_shape
        assert np.all(np.isfinite(output))
    if run_quantization:
        _check_int8(fresh(), images)
    if run_lora:
        _check_lora(fresh(), images)
    trained = None
    if run_fit:
        trained = fresh()
        trained.compile()
        history = trained.fit(images, labels, batch_size=len(images), epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])
    if run_saving:
        # The trained copy when there is one: its compile state comes back too.
        saved = task if trained is None else trained
        loaded = _check_saving(saved, images, {}, tmp_path)
        if trained is not None:
            assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == 1
        _check_preset_round_trip(task, images, tmp_path)
    return task


def run_preset_test(cls, preset, input_data, expected_output_shape, **overrides):
    """`cls.from_preset(preset, **overrides)` is a `cls` with this output shape.

    Returns:
        The loaded model.
    """
    model = cls.from_preset(preset, **overrides)
    assert type(model) is cls
    assert tuple(model(input_data).shape) == expected_output_shape
    name = resolve_preset_name(str(preset))
    assert name is None or name in cls.presets
    return model


@contextlib.contextmanager
def deadline(seconds=10):
    """Raises `TimeoutError` in the block after `seconds` (SIGALRM): a read
    that would block forever fails the test instead of hanging it."""
    def expire(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def load_benchmark(name):
    """The module `benchmarks/<name>.py`, imported from its file."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli_argument_error(argv, capsys):
    """Runs `keras-vmoe argv` in this process; returns argparse's error text
    (asserting exit status 2)."""
    import pytest

    from keras_vmoe import cli

    with pytest.raises(SystemExit) as info:
        cli.main([str(a) for a in argv])
    assert info.value.code == 2
    return capsys.readouterr().err


class Programs:
    """Counts the XLA programs JAX lowers for compilation inside the block."""

    def __enter__(self):
        import jax

        self.count = 0

        def listener(event, duration, **kwargs):
            if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
                self.count += 1

        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        import jax

        jax.monitoring.unregister_event_duration_listener(self._listener)
