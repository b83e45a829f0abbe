"""Sharding constraints the MoE layers put on their token buffers.

Under a distribution, the token groups `(G, ...)` are split over the batch
axes (`data` x `expert`) and the expert-major buffers `(E, G·C, D)` over
`expert` (E) and the remaining batch axes (G·C). Moving from the first
layout to the second is exactly one all-to-all over `expert` (each device
sends the tokens of its own groups to the devices owning their experts),
which XLA/GSPMD emits from these two constraints, as upstream's
`with_sharding_constraint` calls do. Without a distribution, or when a
dimension does not divide its mesh axes (e.g. a batch of one image in
`predict`), the tensor is left unconstrained.
"""

import math

import keras

from keras_vmoe.distribution.layouts import MultiAxisLayout


def _sizes(mesh):
    return dict(zip(mesh.axis_names, mesh.shape, strict=True))


def batch_axes():
    """`(axes, mesh)` the active distribution splits the batch over, or None."""
    dist = keras.distribution.distribution()
    if dist is None:
        return None
    axes = getattr(dist, "batch_axes", None) or (dist.batch_dim_name,)
    axes = tuple(a for a in axes if a)
    return (axes, dist.device_mesh) if axes else None


def _fit(axes, size, sizes):
    """The longest prefix of `axes` whose devices divide `size`."""
    kept = []
    for axis in axes:
        if size % math.prod(sizes[a] for a in (*kept, axis)):
            break
        kept.append(axis)
    kept = [a for a in kept if sizes[a] > 1]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else tuple(kept)


def _constrain(x, axes, mesh):
    if all(a is None for a in axes):
        return x

    return keras.distribution.distribute_tensor(x, MultiAxisLayout(axes, mesh))


def constrain_groups(x):
    """Splits axis 0 (token groups G) of `x` over the batch mesh axes."""
    active = batch_axes()
    if active is None:
        return x
    axes, mesh = active
    lead = _fit(axes, x.shape[0], _sizes(mesh))
    return _constrain(x, (lead,) + (None,) * (len(x.shape) - 1), mesh)


def constrain_expert_major(x, expert_axis, mesh):
    """`(E, G·C, ...)`: E over `expert_axis`, G·C over the other batch axes."""
    sizes = _sizes(mesh)
    active = batch_axes()
    rest = tuple(a for a in (active[0] if active else ()) if a != expert_axis)
    first = expert_axis if x.shape[0] % sizes[expert_axis] == 0 else None
    second = _fit(rest, x.shape[1], sizes) if len(x.shape) > 1 else None
    axes = (first, second) + (None,) * (len(x.shape) - 2)
    return _constrain(x, axes[: len(x.shape)], mesh)
