"""The earlier distribution API, deprecated: `(batch, expert)` meshes, the
first expert-parallel helpers and one alias per layout.

`keras_vmoe.distribution.make_mesh`, `make_distribution` and `layout_map`
build every layout; the names here warn when reached through
`keras_vmoe.distribution`, importing this module warns, and both go in
0.4.0.
"""

import keras

from keras_vmoe.backend_support import DISTRIBUTION_ALTERNATIVE
from keras_vmoe.backend_support import require_jax
from keras_vmoe.distribution.layouts import make_distribution
from keras_vmoe.distribution.layouts import make_mesh
from keras_vmoe.keras_internals import flatten_layers
from keras_vmoe.utils.deprecation import warn_renamed

warn_renamed(__name__, "keras_vmoe.distribution.make_mesh, make_distribution and layout_map",
             stacklevel=2)

# Weight paths of the fused expert weights (see `keras_vmoe.layers.Experts`).
EXPERT_WEIGHT_PATTERNS = (
    r".*experts/kernel_0",
    r".*experts/bias_0",
    r".*experts/kernel_1",
    r".*experts/bias_1",
)


def device_mesh(expert_parallelism=1, devices=None, batch_axis="batch",
                expert_axis="expert"):
    """A 2-D mesh `(batch, expert)` over the available devices.

    Args:
        expert_parallelism: int, devices along the expert axis; must divide
            the number of devices.
        devices: optional list of devices (default: all devices).
        batch_axis: name of the data-parallel axis.
        expert_axis: name of the expert-parallel axis.

    Returns:
        A `keras.distribution.DeviceMesh`.
    """
    require_jax("keras_vmoe.distribution.device_mesh", DISTRIBUTION_ALTERNATIVE)
    devices = devices or keras.distribution.list_devices()
    count = len(devices)
    if expert_parallelism < 1 or count % expert_parallelism:
        raise ValueError(
            f"`expert_parallelism` ({expert_parallelism}) must be >= 1 and divide "
            f"the number of devices ({count}). Valid values: "
            f"{[d for d in range(1, count + 1) if count % d == 0]}."
        )
    return keras.distribution.DeviceMesh(
        (count // expert_parallelism, expert_parallelism),
        (batch_axis, expert_axis),
        devices,
    )


def expert_parallel_layout_map(mesh, expert_axis="expert"):
    """Layout map that shards expert weights along their leading E axis.

    Args:
        mesh: a `DeviceMesh` with an axis named `expert_axis`.
        expert_axis: the mesh axis the experts are split over.

    Returns:
        A `keras.distribution.LayoutMap`; unmatched weights are replicated.
    """
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[EXPERT_WEIGHT_PATTERNS[0]] = (expert_axis, None, None)
    layout_map[EXPERT_WEIGHT_PATTERNS[1]] = (expert_axis, None)
    layout_map[EXPERT_WEIGHT_PATTERNS[2]] = (expert_axis, None, None)
    layout_map[EXPERT_WEIGHT_PATTERNS[3]] = (expert_axis, None)
    return layout_map


def check_expert_sharding(model, mesh, expert_axis="expert"):
    """Raises a clear error if a MoE layer's experts do not divide the mesh axis.

    Keras would otherwise fail later with an `IndivisibleError`.
    """
    size = dict(zip(mesh.axis_names, mesh.shape, strict=True))[expert_axis]
    for layer in _moe_layers(model):
        if layer.num_experts % size:
            raise ValueError(
                f"Layer {layer.name!r} has num_experts={layer.num_experts}, which is "
                f"not divisible by the '{expert_axis}' mesh axis of size {size}. "
                "Use an expert parallelism that divides the number of experts."
            )


def _moe_layers(model):
    # The MoE layers are recognised by their expert bank (`experts`) and
    # count: the layers sit above this module.
    return [layer for layer in flatten_layers(model)
            if hasattr(layer, "experts") and hasattr(layer, "num_experts")]


def expert_parallel(model_fn, expert_parallelism, devices=None):
    """Builds a model with expert-sharded weights and a data-parallel batch.

    Args:
        model_fn: zero-argument callable that builds the model.
        expert_parallelism: devices along the expert axis.
        devices: optional devices.

    The batch is split over all the devices (`data` x `expert`), as
    upstream; see `make_distribution` for the other layouts.

    Returns:
        `(model, distribution)`; the distribution stays set globally. When
        building the model fails, the previous global distribution is
        restored.
    """
    require_jax("keras_vmoe.distribution.expert_parallel", DISTRIBUTION_ALTERNATIVE)
    devices = devices or keras.distribution.list_devices()
    if expert_parallelism < 1 or len(devices) % expert_parallelism:
        device_mesh(expert_parallelism, devices)  # raises the clear error
    mesh = make_mesh(expert=expert_parallelism, devices=devices)
    dist = make_distribution("expert", mesh)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(dist)
    try:
        model = model_fn()
        check_expert_sharding(model, mesh)
    except BaseException:
        keras.distribution.set_distribution(previous)
        raise
    return model, dist


def data_parallel(mesh=None, **kwargs):
    """`make_distribution("data", mesh, **kwargs)`: replicated weights."""
    return make_distribution("data", mesh, **kwargs)


def expert_parallel_distribution(mesh=None, **kwargs):
    """`make_distribution("expert", mesh, **kwargs)`: experts over `expert`."""
    return make_distribution("expert", mesh, **kwargs)


def expert_model_parallel(mesh, **kwargs):
    """`make_distribution("expert_model", mesh, **kwargs)`: + heads/MLP over `model`."""
    return make_distribution("expert_model", mesh, **kwargs)


def pod_parallel(mesh, **kwargs):
    """`make_distribution("pod", mesh, **kwargs)`: + weights and slots over `data`."""
    return make_distribution("pod", mesh, **kwargs)
