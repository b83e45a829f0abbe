"""Reading upstream parameters from any source, without Keras.

Sources: vmoe partitioned checkpoints, upstream trainer states (Orbax and
`workdir/ckpt_<step>`), vision_transformer `.npz` files and in-memory
`{path: array}` dicts; only the parameter subtree is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from collections.abc import Mapping

import numpy as np

from keras_vmoe.formats import partitioned
from keras_vmoe.formats import train_state
from keras_vmoe.formats import vit_npz
from keras_vmoe.formats.train_state import ResolvedCheckpoint
from keras_vmoe.formats.train_state import strip_index_suffix

__all__ = [
    "is_npz",
    "iter_upstream_params",
    "load_upstream_params",
    "read_upstream_shapes",
    "resolve_upstream",
    "strip_index_suffix",
]


def is_npz(source) -> bool:
    return isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(".npz")


def resolve_upstream(source, step: int | None = None):
    """Finds what to read in an upstream source (no array is read).

    Args:
        source: a partitioned checkpoint prefix, a trainer checkpoint (Orbax
            directory, `workdir/ckpt` prefix or workdir; see
            `keras_vmoe.formats.train_state`), a `.npz` path, a mapping
            `{path: array}` or an already resolved checkpoint.
        step: training step to convert (trainer checkpoints only; default
            the latest).

    Returns:
        A `ResolvedCheckpoint` for checkpoint paths; a `.npz` path as it is;
        a mapping with its parameter subtree only (`{"params/a": ...}` gives
        `{"a": ...}`).

    Raises:
        keras_vmoe.formats.CheckpointError: see `resolve_checkpoint`.
        ValueError: `step` given for a source that has no steps.
    """
    if isinstance(source, (Mapping, ResolvedCheckpoint)) or is_npz(source):
        if step is not None:
            what = ("a .npz file" if is_npz(source) else
                    "an in-memory parameter dict" if isinstance(source, Mapping) else
                    "an already resolved checkpoint")
            raise ValueError(
                f"step={step!r} selects a step of a trainer checkpoint, but the "
                f"source is {what}, which has no steps."
            )
        if isinstance(source, Mapping) and source:
            # A flat train state in memory: keep its parameter subtree.
            subtree = train_state.select_params_subtree(source, "The parameter dict")
            if subtree is not None:
                return {key[len(subtree) + 1:]: value for key, value in source.items()
                        if key.startswith(subtree + "/")}
        return source
    return train_state.resolve_checkpoint(source, step=step)


def read_upstream_shapes(source) -> dict[str, tuple[int, ...]]:
    """`{upstream_path: shape}` of a checkpoint, without reading the weights.

    Args:
        source: a partitioned checkpoint prefix (local or gs://), a trainer
            checkpoint (its latest step), a `ResolvedCheckpoint`, a `.npz`
            path, or a mapping `{path: array}`.
    """
    source = resolve_upstream(source)
    if isinstance(source, Mapping):
        return {k: tuple(np.shape(v)) for k, v in source.items()}
    if isinstance(source, ResolvedCheckpoint):
        return dict(source.shapes)
    return vit_npz.read_shapes(source)


def iter_upstream_params(source) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(upstream_path, array)` of the model parameters, one at a time.

    Args:
        source: as for `read_upstream_shapes`. An Orbax checkpoint's
            parameters are restored at once.
    """
    source = resolve_upstream(source)
    if isinstance(source, Mapping):
        for key, value in source.items():
            yield key, np.asarray(value)
        return
    if isinstance(source, ResolvedCheckpoint):
        yield from source.iter_params()
        return
    yield from vit_npz.iter_arrays(source)


def load_upstream_params(prefix, step: int | None = None) -> dict[str, np.ndarray]:
    """Reads an upstream checkpoint into a flat `{path: array}` dict.

    Args:
        prefix: a vmoe partitioned checkpoint prefix (local path or gs://;
            `P.index` is accepted too), a trainer checkpoint (see
            `resolve_upstream`) or a vision_transformer `.npz` file.
        step: training step of a trainer checkpoint (default: the latest).

    Returns:
        `{"/"-joined upstream path: numpy array}` (bfloat16 as `ml_dtypes.bfloat16`).

    Raises:
        keras_vmoe.formats.CheckpointError: missing, truncated or malformed files.
    """
    source = resolve_upstream(prefix, step)
    if isinstance(source, ResolvedCheckpoint):
        if source.format == "partitioned" and source.subtree is None:
            return partitioned.restore_flat(source.location)
        return dict(source.iter_params())
    return dict(iter_upstream_params(source))

