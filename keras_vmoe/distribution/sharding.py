"""Sharding constraints the MoE layers put on their token buffers.

Token groups `(G, ...)` go over the batch axes, expert-major buffers
`(E, G·C, D)` over `expert` and the other batch axes: XLA moves between the
two with one all-to-all. A dimension its mesh axes do not divide is left as is.
"""

import math

import keras

from keras_vmoe.distribution.layouts import MultiAxisLayout
from keras_vmoe.distribution.validation import mesh_sizes


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
    lead = _fit(axes, x.shape[0], mesh_sizes(mesh))
    return _constrain(x, (lead,) + (None,) * (len(x.shape) - 1), mesh)


def constrain_expert_major(x, expert_axis, mesh):
    """`(E, G·C, ...)`: E over `expert_axis`, G·C over the other batch axes."""
    sizes = mesh_sizes(mesh)
    active = batch_axes()
    rest = tuple(a for a in (active[0] if active else ()) if a != expert_axis)
    first = expert_axis if x.shape[0] % sizes[expert_axis] == 0 else None
    second = _fit(rest, x.shape[1], sizes) if len(x.shape) > 1 else None
    axes = (first, second) + (None,) * (len(x.shape) - 2)
    return _constrain(x, axes[: len(x.shape)], mesh)
