"""Device meshes, layout maps and `keras.distribution` objects for V-MoE.

Mesh axes `data` (batch), `expert` (expert-stacked weights; the batch is split
over `data` x `expert`) and `model` (heads, MLP hidden units); layouts
`LAYOUTS`: `"data"`, `"expert"`, `"expert_model"` and `"pod"` (FSDP-style).
"""

import math

import keras

from keras_vmoe.distribution.validation import check_divisible
from keras_vmoe.distribution.validation import mesh_sizes
from keras_vmoe.utils.backend import DISTRIBUTION_ALTERNATIVE
from keras_vmoe.utils.backend import require_jax
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

DATA, EXPERT, MODEL = "data", "expert", "model"
MESH_AXES = (DATA, EXPERT, MODEL)
LAYOUTS = ("data", "expert", "expert_model", "pod")


class MultiAxisLayout(keras.distribution.TensorLayout):
    """A `TensorLayout` whose entries may be tuples of mesh axes.

    `("data", "expert")` in one position splits that dimension over both axes.

    Args:
        axes: one mesh axis name, tuple of names or `None` per dimension.
        device_mesh: the `keras.distribution.DeviceMesh`.
    """

    def _validate_axes(self):
        if self._device_mesh:
            names = set()
            for entry in self._axes:
                names.update(entry if isinstance(entry, tuple) else (entry,))
            unknown = names - {None} - set(self._device_mesh.axis_names)
            if unknown:
                raise ValueError(
                    f"Unknown mesh axes {sorted(unknown)} in layout {self._axes}. "
                    f"Valid axes: {self._device_mesh.axis_names}."
                )


class ModelParallel(keras.distribution.ModelParallel):
    """`keras.distribution.ModelParallel` whose batch is split over several axes.

    Upstream splits the batch over the `expert` axis too, so that each device
    routes its own token groups.

    Args:
        layout_map: `keras.distribution.LayoutMap`.
        batch_axes: tuple of mesh axis names the batch is split over.
        **kwargs: `keras.distribution.ModelParallel` arguments.
    """

    def __init__(self, *, layout_map, batch_axes=(DATA, EXPERT), **kwargs):
        self._batch_axes = tuple(batch_axes)
        super().__init__(layout_map=layout_map, batch_dim_name=self._batch_axes[0],
                         **kwargs)

    @property
    def batch_axes(self):
        return self._batch_axes

    @property
    def num_model_replicas(self):
        sizes = mesh_sizes(self.device_mesh)
        return math.prod(sizes[axis] for axis in self._batch_axes)

    def get_data_layout(self, data_shape):
        axes = [None] * len(data_shape)
        axes[0] = self._batch_axes if len(self._batch_axes) > 1 else self._batch_axes[0]
        return MultiAxisLayout(axes, self.device_mesh)


def make_mesh(data=None, expert=1, model=1, devices=None):
    """A `("data", "expert", "model")` `DeviceMesh`.

    Args:
        data: devices along `data`; default: all the devices left over.
        expert: devices along `expert`.
        model: devices along `model`.
        devices: list of devices (default: all, over every process).

    Returns:
        A `keras.distribution.DeviceMesh`.

    Example:

    >>> mesh = make_mesh(data=2, expert=4)  # 8 devices  # doctest: +SKIP
    """
    require_jax("keras_vmoe.distribution.make_mesh", DISTRIBUTION_ALTERNATIVE)
    devices = devices or keras.distribution.list_devices()
    count = len(devices)
    check_int(expert, "expert")
    check_int(model, "model")
    if data is None:
        if count % (expert * model):
            raise ValueError(
                f"expert x model = {expert} x {model} must divide the {count} devices."
            )
        data = count // (expert * model)
    if data * expert * model != count:
        raise ValueError(
            f"The mesh data x expert x model = {data} x {expert} x {model} = "
            f"{data * expert * model} must use exactly the {count} available devices."
        )
    return keras.distribution.DeviceMesh((data, expert, model), MESH_AXES, devices)


# Variable path regex -> axes: `E` expert, `M` model, `F` fully-sharded (pod).
_EXPERT_RULES = {
    r".*experts/kernel_0": ("E", "F", "M"),  # (E, D, M)
    r".*experts/bias_0": ("E", "M"),  # (E, M)
    r".*experts/kernel_1": ("E", "M", "F"),  # (E, M, D)
    r".*experts/bias_1": ("E", None),  # (E, D)
}
_MODEL_RULES = {
    r".*attention/(query|key|value)/kernel": ("F", "M", None),  # (D, N, K)
    r".*attention/(query|key|value)/bias": ("M", None),  # (N, K)
    r".*attention/out/kernel": ("M", None, "F"),  # (N, K, D)
    r".*mlp/dense_0/kernel": ("F", "M"),  # (D, M)
    r".*mlp/dense_0/bias": ("M",),  # (M,)
    r".*mlp/dense_1/kernel": ("M", "F"),  # (M, D)
}


def layout_map(mesh, layout="expert"):
    """Layout map of a V-MoE/ViT for one of `LAYOUTS` on a `make_mesh` mesh.

    Args:
        mesh: `DeviceMesh` with axes `("data", "expert", "model")`.
        layout: one of `LAYOUTS`.

    Returns:
        A `keras.distribution.LayoutMap`; other weights are replicated.
    """
    require_jax("keras_vmoe.distribution.layout_map", DISTRIBUTION_ALTERNATIVE)
    check_one_of(layout, "layout", LAYOUTS)
    missing = set(MESH_AXES) - set(mesh.axis_names)
    if missing:
        raise ValueError(
            f"The mesh must have the axes {MESH_AXES} (see `make_mesh`); it has "
            f"{mesh.axis_names}."
        )
    letters = {
        "E": EXPERT if layout != "data" else None,
        "M": MODEL if layout in ("expert_model", "pod") else None,
        "F": DATA if layout == "pod" else None,
        None: None,
    }
    result = keras.distribution.LayoutMap(mesh)
    rules = dict(_EXPERT_RULES)
    if layout in ("expert_model", "pod"):
        rules.update(_MODEL_RULES)
    for pattern, axes in rules.items():
        result[pattern] = tuple(letters[a] for a in axes)
    return result


def make_distribution(layout, mesh=None, *, config=None, batch_size=None,
                      auto_shard_dataset=True):
    """The `keras.distribution.Distribution` of a layout, validated up front.

    Args:
        layout: one of `LAYOUTS`.
        mesh: `make_mesh` mesh (default: all devices on `data` or `expert`).
        config: optional backbone config dict to check against the mesh.
        batch_size: optional global batch size to check.
        auto_shard_dataset: as Keras' (`False`: each process feeds its shard).

    Returns:
        `keras.distribution.DataParallel` for `"data"`, else `ModelParallel`.
    """
    require_jax("keras_vmoe.distribution.make_distribution", DISTRIBUTION_ALTERNATIVE)
    check_one_of(layout, "layout", LAYOUTS)
    if mesh is None:
        mesh = make_mesh() if layout == "data" else make_mesh(
            data=1, expert=len(keras.distribution.list_devices()))
    if config is not None or batch_size is not None:
        check_divisible(mesh_sizes(mesh), layout, config=config, batch_size=batch_size)
    if layout == "data":
        if math.prod(mesh.shape) != mesh_sizes(mesh)[DATA]:
            raise ValueError(
                "The 'data' layout replicates the model: use a mesh with expert=1 "
                f"and model=1. Received mesh shape {mesh_sizes(mesh)}.")
        flat = keras.distribution.DeviceMesh(
            (math.prod(mesh.shape),), (DATA,), mesh.devices.reshape(-1)
        )
        return keras.distribution.DataParallel(device_mesh=flat,
                                               auto_shard_dataset=auto_shard_dataset)
    return ModelParallel(layout_map=layout_map(mesh, layout), batch_axes=(DATA, EXPERT),
                         auto_shard_dataset=auto_shard_dataset)
