"""Building models without drawing their initializers, or drawing them all at once.

`skip_initializers()`: weights that a file then assigns are created as host
zeros (no random draw, no XLA program). `batched_initializers()`: random
weights are drawn together in one jitted program, with the same values.
"""

import contextlib
import functools
import inspect
import math
import mmap
import threading

import keras
import numpy as np

from keras_vmoe.utils import keras_internals

_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_local_restore = []


class UnassignedWeightsError(ValueError):
    """A model built without initializers has weights that were never loaded."""


class SkippedInitializers:
    """The variables created under one `skip_initializers()` scope, and which
    of them were assigned while it was active."""

    def __init__(self):
        self._skipped = {}
        self._initializers = {}
        self._assigned = set()

    @property
    def num_skipped(self):
        """How many variables were created without running their initializer."""
        return len(self._skipped)

    def unassigned(self, model):
        """The variables of `model` created as placeholders and never assigned."""
        return [
            v for v in model.variables
            if id(v) in self._skipped and id(v) not in self._assigned
        ]

    def draw_unassigned(self):
        """Draws each placeholder never assigned; returns how many."""
        missing = [key for key in self._skipped if key not in self._assigned]
        batch = _Batch() if keras.backend.backend() == "jax" else None
        for key in missing:
            variable, initializer = self._skipped[key], self._initializers[key]
            self._assigned.add(key)
            host = _host_value(initializer, variable)
            if host is not None:
                variable.assign(host)
            elif batch is None or not batch.queue(variable, initializer):
                variable.assign(initializer(variable.shape, dtype=variable.dtype))
        if batch is not None:
            batch.flush()
        return len(missing)

    def check_assigned(self, model, source=None):
        """Raises `UnassignedWeightsError` unless every placeholder of `model`
        (or layer) was assigned; `source` names the weights' origin."""
        missing = self.unassigned(model)
        if missing:
            paths = [v.path for v in missing]
            shown = ", ".join(paths[:10]) + (", ..." if len(paths) > 10 else "")
            origin = f" from {source}" if source else ""
            raise UnassignedWeightsError(
                f"{len(paths)} weight(s) of the model were not loaded{origin}: "
                f"{shown}. The weights do not cover the model."
            )


def _numpy_dtype(dtype):
    dtype = keras.backend.standardize_dtype(dtype)
    try:
        return np.dtype(dtype)
    except TypeError:  # bfloat16 and float8 types live in ml_dtypes.
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype))


def _placeholder(variable):
    return _host_zeros(tuple(variable.shape), _numpy_dtype(variable.dtype))


class _HostMap(mmap.mmap):
    """An anonymous map of `_host_zeros` (file maps must never go to JAX)."""


def _host_zeros(shape, dtype):
    """Zeros in a fresh anonymous memory map: page-aligned (JAX aliases them)
    and taking no memory until written, unlike small `np.zeros` arrays."""
    count = math.prod(shape)
    if count == 0:
        return np.zeros(shape, dtype)
    buffer = _HostMap(-1, count * dtype.itemsize)
    return np.frombuffer(buffer, dtype, count=count).reshape(shape)


# Smaller `.weights.h5` datasets are not worth a memory map of their own.
_ALIASED_READ_BYTES = 1 << 20


def _read_aligned(dataset):
    """A large `.weights.h5` dataset read into `_host_zeros`, or None."""
    if _skipping() is None or keras.backend.backend() != "jax":
        return None
    dtype = dataset.dtype
    if ("dtype" in dataset.attrs or dtype.kind not in "fiu"
            or dataset.size * dtype.itemsize < _ALIASED_READ_BYTES):
        return None  # bfloat16 (marked by Keras), strings, small weights
    values = _host_zeros(tuple(dataset.shape), dtype)
    dataset.read_direct(values)
    return values


def _is_host_map(value):
    while isinstance(value, (np.ndarray, memoryview)):
        value = value.base if isinstance(value, np.ndarray) else value.obj
    return isinstance(value, _HostMap)


def _innermost(*kinds):
    for record in reversed(getattr(_local, "stack", ())):
        if isinstance(record, kinds):
            return record
    return None


def _skipping():
    """The innermost `skip_initializers` record (it wins over batching)."""
    return _innermost(SkippedInitializers)


def _batching():
    """The innermost `batched_initializers` record, None inside `_Eager`."""
    return None if _innermost(_Eager) is not None else _innermost(_Batch)


def _install():
    original_init = keras.Variable._initialize_with_initializer
    original_assign = keras.Variable.assign
    original_convert = keras.Variable._convert_to_tensor
    samplers = keras_internals.initializer_random_module()
    original_samplers = {name: getattr(samplers, name)
                         for name in keras_internals.BACKEND_SAMPLERS}

    def convert_to_tensor(variable, value, dtype=None):
        # JAX would compile a conversion program for a Python number.
        if dtype is not None and isinstance(value, (bool, int, float)) and (
                _skipping() is not None or _batching() is not None):
            value = np.asarray(value, _numpy_dtype(dtype))
        if (_skipping() is not None and keras.backend.backend() == "jax"
                and _is_host_map(value) and dtype is not None
                and value.dtype == _numpy_dtype(dtype)):
            import jax

            return jax.device_put(value, may_alias=True)
        return original_convert(variable, value, dtype=dtype)

    def initialize_with_initializer(variable, initializer):
        if not isinstance(initializer, keras.initializers.Initializer):
            return original_init(variable, initializer)
        record = _skipping()
        if record is not None:
            keras_internals.initialize_variable(variable, _placeholder(variable))
            record._skipped[id(variable)] = variable
            record._initializers[id(variable)] = initializer
            return None
        batch = _batching()
        if batch is not None and batch.defer(variable, initializer):
            return None
        return original_init(variable, initializer)

    def assign(variable, value):
        result = original_assign(variable, value)
        # Any enclosing scope may have created the variable.
        for record in getattr(_local, "stack", ()):
            if isinstance(record, SkippedInitializers) and id(variable) in record._skipped:
                record._assigned.add(id(variable))
            elif isinstance(record, _Batch):
                record._pending.pop(id(variable), None)  # the assigned value stays
        return result

    def recorder(name):
        original = original_samplers[name]
        signature = inspect.signature(original)

        def sampler(*args, **kwargs):
            if not getattr(_local, "recording", False):
                return original(*args, **kwargs)
            return Draw.sample(name, signature.bind(*args, **kwargs))

        return sampler

    restore_variable = keras_internals.patch_variable_methods(
        _initialize_with_initializer=initialize_with_initializer, assign=assign,
        _convert_to_tensor=convert_to_tensor)
    restore_reads = keras_internals.patch_h5_reads(_read_aligned)
    for name in original_samplers:
        setattr(samplers, name, recorder(name))

    def restore():
        for name, original in original_samplers.items():
            setattr(samplers, name, original)
        restore_reads()
        restore_variable()

    return restore


@contextlib.contextmanager
def _scope(record):
    global _patch_users
    if not hasattr(_local, "stack"):
        _local.stack = []
    with _patch_lock:
        if _patch_users == 0:
            _local_restore.append(_install())
        _patch_users += 1
    _local.stack.append(record)
    try:
        yield record
    finally:
        _local.stack.pop()
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                _local_restore.pop()()


@contextlib.contextmanager
def skip_initializers():
    """Variables created in this block skip their initializers (zeros instead).

    Wrap the build and the loading (assignments are recorded only inside the
    block), then call `check_assigned(model)` on the yielded
    `SkippedInitializers` record.

    Examples:

    ```python
    import keras
    from keras_vmoe.utils.initialization import skip_initializers

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    build().save_weights("dense.weights.h5")
    with skip_initializers() as skipped:
        model = build()  # zeros on the host: nothing drawn, nothing compiled
        model.load_weights("dense.weights.h5")
    skipped.check_assigned(model)  # every weight came from the file
    ```
    """
    outer = _skipping()
    with _scope(SkippedInitializers()) as record:
        yield record
    if outer is not None:
        # A nested scope's variables belong to the enclosing one too.
        outer._skipped.update(record._skipped)
        outer._initializers.update(record._initializers)
        outer._assigned.update(record._assigned)


class Draw:
    """The random values of one weight, drawn later in one jitted program.

    `spec` is hashable (sampler, shape, dtype, reshapes/tiles/stacks);
    `args` are the program's inputs (key and scalars). A wrapping
    initializer defines `batched_draw(shape, dtype)`, returning the `Draw`
    of `draw_of(inner, ...)` transformed as its `__call__` does, or None.
    """

    def __init__(self, spec, args):
        self.spec = spec
        self.args = args

    @classmethod
    def sample(cls, name, bound):
        """The call `sampler(**bound.arguments)` of Keras' backend random module."""
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        shape = tuple(int(d) for d in arguments.pop("shape"))
        dtype = keras.backend.standardize_dtype(arguments.pop("dtype")
                                                or keras.config.floatx())
        seed = arguments.pop("seed")
        # float32 only: Keras' Python numbers then act as float32 inputs.
        if dtype != "float32" or not all(
                type(v) in (int, float) for v in arguments.values()) or (
                type(seed) is not int) or not 0 <= seed < 2**31:
            raise _NotDeferrable
        if name == "truncated_normal":
            arguments.update(_TRUNCATION)
        names = tuple(sorted(arguments))
        # Keras' `draw_seed` key of an integer seed, made on the host.
        key = np.array([seed, 0], np.uint32)
        return cls(("sample", name, shape, dtype, names),
                   (key, tuple(arguments[n] for n in names)))

    def reshape(self, shape):
        """This draw reshaped (as `keras.ops.reshape`)."""
        return Draw(("reshape", self.spec, tuple(int(d) for d in shape)), self.args)

    def tile(self, count):
        """`count` copies along a new first axis (as `ops.tile(value[None], ...)`)."""
        return Draw(("tile", self.spec, int(count)), self.args)

    @staticmethod
    def stack(draws):
        """The draws stacked along a new first axis (as `keras.ops.stack`)."""
        return Draw(("stack", tuple(d.spec for d in draws)), tuple(d.args for d in draws))


class _NotDeferrable(Exception):
    """An initializer call that cannot be deferred."""


def _keras_samplers():
    """The `__call__` of Keras' initializers that return one sampler call."""
    init = keras.initializers
    return (init.RandomNormal.__call__, init.TruncatedNormal.__call__,
            init.RandomUniform.__call__, init.VarianceScaling.__call__)


def draw_of(initializer, shape, dtype):
    """The `Draw` of `initializer(shape, dtype)`, or None (drawn as usual).

    Keras' random initializers with an integer seed record their sampler
    call instead of making it; one with `batched_draw` gives its own.
    """
    custom = getattr(initializer, "batched_draw", None)
    if custom is not None:
        return custom(tuple(shape), dtype)
    if type(initializer).__call__ not in _keras_samplers():
        return None
    seed = getattr(initializer, "seed", None)
    if type(seed) is not int or not 0 <= seed < 2**31:
        return None  # a SeedGenerator (stateful) or an unusual seed
    _local.recording = True
    try:
        draw = initializer(tuple(shape), dtype=dtype)
    except _NotDeferrable:
        return None
    finally:
        _local.recording = False
    return draw if isinstance(draw, Draw) else None


def _host_value(initializer, variable):
    """The value of a constant initializer, on the host, or None."""
    init = keras.initializers
    call = type(initializer).__call__
    dtype = _numpy_dtype(variable.dtype)
    if call is init.Zeros.__call__:
        return _placeholder(variable)
    if call is init.Ones.__call__:
        return np.ones(tuple(variable.shape), dtype)
    value = getattr(initializer, "value", None)
    if call is init.Constant.__call__ and type(value) in (int, float) and (
            np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"):
        # Keras: `cast(value, dtype) * ones(shape, dtype)`, exact.
        return np.full(tuple(variable.shape), np.asarray(value, dtype), dtype)
    return None


class _Batch:
    """The variables of one `batched_initializers` scope waiting for their draw."""

    def __init__(self):
        self._pending = {}  # id(variable) -> (variable, Draw)

    def defer(self, variable, initializer):
        """Creates `variable` now and queues its draw; False to draw as usual."""
        if keras_internals.variable_layout(variable) is not None or (
                keras.distribution.distribution() is not None):
            return False  # Keras draws a sharded variable in its own program
        host = _host_value(initializer, variable)
        if host is not None:
            keras_internals.initialize_variable(variable, host)
            return True
        draw = draw_of(initializer, variable.shape, variable.dtype)
        if draw is None:
            return False
        keras_internals.initialize_variable(variable, _placeholder(variable))
        self._pending[id(variable)] = (variable, draw)
        return True

    def queue(self, variable, initializer):
        """Queues the draw of a variable that exists; False if it cannot be."""
        draw = draw_of(initializer, variable.shape, variable.dtype)
        if draw is not None:
            self._pending[id(variable)] = (variable, draw)
        return draw is not None

    def flush(self):
        """Draws every queued weight in one program and stores the values."""
        pending = list(self._pending.values())
        self._pending.clear()
        if not pending:
            return
        buckets = _buckets([draw.spec for _, draw in pending])
        groups = {}  # sampler call (name, shape, dtype) -> the arguments of its draws
        layouts = tuple(_layout(draw.spec, draw.args, groups, buckets)
                        for _, draw in pending)
        calls = tuple((call, len(members)) for call, members in groups.items())
        import jax

        # On the CPU the weights are cut from the stacked draws on the host:
        # in the program each would be one more kernel to compile.
        on_host = jax.devices()[0].platform == "cpu"
        values = _draw_program()((calls, layouts, on_host),
                                 tuple(_stacked(members) for members in groups.values()))
        if on_host:
            drawn = [np.asarray(group) for group in values]
            values = [np.ascontiguousarray(_assemble(layout, drawn, np))
                      for layout in layouts]
        for (variable, _), value in zip(pending, values, strict=True):
            if isinstance(value, np.ndarray):
                keras_internals.initialize_variable(variable, value)
            else:
                keras_internals.replace_initial_value(variable, value)


class _Eager:
    """A scope in which initializers draw as they are called."""


# Most elements drawn in vain when draws of other sizes share one call.
_PADDING_BUDGET = 1 << 20


def _sample_specs(spec):
    """The sampler calls of a `Draw` spec, in order."""
    if spec[0] == "sample":
        return [spec]
    if spec[0] == "stack":
        return [s for part in spec[1] for s in _sample_specs(part)]
    return _sample_specs(spec[1])


def _buckets(specs):
    """Which sampler call draws each sampler spec: `{spec: call}`.

    With partitionable threefry an element depends only on its key and flat
    index, so calls of other shapes share one call of the largest size.
    """
    import jax

    counts = {}
    for spec in (s for top in specs for s in _sample_specs(top)):
        counts[spec] = counts.get(spec, 0) + 1
    if not (jax.config.jax_threefry_partitionable
            and jax.config.jax_default_prng_impl == "threefry2x32"):
        return {spec: spec for spec in counts}
    families = {}
    for spec in counts:
        _, name, shape, dtype, names = spec
        families.setdefault((name, dtype, names), []).append(spec)
    calls = {}
    for (name, dtype, names), members in families.items():
        members.sort(key=lambda spec: -math.prod(spec[2]))
        size = None
        for spec in members:
            n = math.prod(spec[2])
            if size is None or (size - n) * counts[spec] > _PADDING_BUDGET:
                size = n  # a new call of this size
            calls[spec] = ("sample", name, (size,), dtype, names)
    return calls


def _layout(spec, args, groups, buckets):
    """`spec` with each sampler call replaced by `("ref", group, index, shape)`,
    its arguments appended to its group in `groups`."""
    kind = spec[0]
    if kind == "sample":
        members = groups.setdefault(buckets[spec], [])
        members.append(args)
        return ("ref", list(groups).index(buckets[spec]), len(members) - 1, spec[2])
    if kind == "stack":
        return ("stack", tuple(_layout(s, a, groups, buckets)
                               for s, a in zip(spec[1], args, strict=True)))
    return (kind, _layout(spec[1], args, groups, buckets), spec[2])


def _assemble(layout, drawn, ops):
    """One weight from the drawn groups (`ops`: `keras.ops` or `numpy`)."""
    kind = layout[0]
    if kind == "ref":
        _, group, index, shape = layout
        return ops.reshape(drawn[group][index][: math.prod(shape)], shape)
    if kind == "stack":
        return ops.stack([_assemble(part, drawn, ops) for part in layout[1]], axis=0)
    value = _assemble(layout[1], drawn, ops)
    if kind == "reshape":
        return ops.reshape(value, layout[2])
    return ops.tile(value[None], (layout[2],) + (1,) * value.ndim)


def _sample(name, shape, dtype, key, scalars):
    """Keras' JAX sampler `name`, each eager step behind an optimization
    barrier so that XLA neither fuses nor reassociates them."""
    import jax

    barrier = jax.lax.optimization_barrier
    if name == "uniform":
        return jax.random.uniform(key, shape=shape, dtype=dtype,
                                  minval=scalars["minval"], maxval=scalars["maxval"])
    if name == "normal":
        sample = jax.random.normal(key, shape=shape, dtype=dtype)
    else:
        sample = jax.random.truncated_normal(key, shape=shape, dtype=dtype,
                                             lower=scalars["lower"], upper=scalars["upper"])
    return barrier(barrier(sample) * scalars["stddev"]) + scalars["mean"]


# Keras' JAX `truncated_normal` draws in (lower, upper) = (-2, 2).
_TRUNCATION = {"lower": -2.0, "upper": 2.0}


def _stacked(args):
    """The arguments of several draws, stacked for `jax.vmap` (numbers as float32)."""
    import jax

    def stack(*leaves):
        if isinstance(leaves[0], np.ndarray):
            return np.stack(leaves)
        return np.asarray(leaves, np.float32)

    return jax.tree.map(stack, *args)


@functools.cache
def _draw_program():
    """One jitted function for every batched build (compiled once per set of specs)."""
    import jax

    def draw_all(plan, args):
        calls, layouts, on_host = plan
        drawn = []
        for (call, _), group in zip(calls, args, strict=True):
            # Vmapped draws give each draw's own values; the barrier keeps
            # each group apart, as when each initializer ran its own program.
            _, name, shape, dtype, names = call

            def sample(key, scalars, name=name, shape=shape, dtype=dtype, names=names):
                return _sample(name, shape, dtype, key,
                               dict(zip(names, scalars, strict=True)))

            drawn.append(jax.lax.optimization_barrier(jax.vmap(sample)(*group)))
        if on_host:
            return drawn
        return [_assemble(layout, drawn, keras.ops) for layout in layouts]

    return jax.jit(draw_all, static_argnums=0)


@contextlib.contextmanager
def batched_initializers():
    """Random weights created in this block are drawn together at its end.

    On JAX, Keras' random initializers are drawn at the end of the outermost
    block in one program, with the same values; constants fill on the host;
    a variable assigned in the block keeps its value. Nothing changes on
    other backends, with a `keras.distribution`, or under
    `skip_initializers()` / `eager_initializers()`.

    Examples:

    ```python
    import keras
    from keras_vmoe.utils.initialization import batched_initializers

    with batched_initializers():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    print(model.layers[0].kernel.shape)  # drawn at the end of the block
    ```
    """
    if keras.backend.backend() != "jax":
        yield
        return
    outer = _innermost(_Batch)
    with _scope(_Batch()) as record:
        yield
    if outer is not None:
        outer._pending.update(record._pending)  # drawn with the outer block's
    else:
        record.flush()


@contextlib.contextmanager
def eager_initializers():
    """Initializers in this block draw as they are called (as plain Keras does);
    `batched_initializers()` blocks inside or around it batch nothing."""
    with _scope(_Eager()):
        yield


def batched_build(function):
    """Runs a model constructor or builder under `batched_initializers()`."""

    @functools.wraps(function)
    def build(*args, **kwargs):
        with batched_initializers():
            return function(*args, **kwargs)

    # Keras' `getfullargspec` reads `__signature__`, not `__wrapped__`.
    build.__signature__ = inspect.signature(function)
    return build


def _load_keras_file(load, read_config):
    """Keras' `.keras` loader `load`, skipping initializers for keras_vmoe models."""

    @functools.wraps(load)
    def loader(source, *args, **kwargs):
        try:
            config = read_config(source)
        except Exception:  # noqa: BLE001 - Keras' own loader says what is wrong
            config = None
        name = config.get("registered_name", "") if isinstance(config, dict) else ""
        if not str(name).startswith("keras_vmoe>"):
            return load(source, *args, **kwargs)
        with skip_initializers() as skipped:
            model = load(source, *args, **kwargs)
            # What Keras may leave unassigned (an optimizer state) is drawn.
            skipped.draw_unassigned()
        return model

    return loader


_keras_file_patch = []


def skip_initializers_in_keras_files():
    """Makes `keras.saving.load_model` of a keras_vmoe model (`.keras` file,
    folder or pickle) build under `skip_initializers()`; idempotent."""
    with _patch_lock:
        if not _keras_file_patch:
            _keras_file_patch.append(keras_internals.patch_keras_file_loaders(
                _load_keras_file))
