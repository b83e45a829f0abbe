"""Finds the model parameters in upstream vmoe checkpoints, train states included.

`resolve_checkpoint` accepts a partitioned checkpoint prefix, a trainer prefix
(`workdir/ckpt` with `ckpt_<step>.index` files) or workdir, and Orbax
`CheckpointManager`, step or item directories; it picks the parameter subtree
(`PARAMS_SUBTREES`) so that optimizer state is never read. Only Orbax
checkpoints need `orbax-checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_vmoe.formats import partitioned
from keras_vmoe.formats.filesystem import _HTTPFS
from keras_vmoe.formats.filesystem import _fs
from keras_vmoe.formats.partitioned import CheckpointError
from keras_vmoe.formats.urls import redact
from keras_vmoe.utils import memory_budget
from keras_vmoe.utils.validation import check_int

__all__ = [
    "ORBAX_INSTALL_COMMAND",
    "PARAMS_SUBTREES",
    "CheckpointError",
    "OrbaxNotInstalledError",
    "ResolvedCheckpoint",
    "resolve_checkpoint",
    "select_params_subtree",
]

ORBAX_INSTALL_COMMAND = 'pip install "keras-vmoe[orbax]"'

# Where a train state keeps the model parameters, in order of preference:
# the live parameters first, then an exponential moving average, then the
# `target` of the pre-optax `flax.optim` optimizers.
PARAMS_SUBTREES = ("params", "ema_params", "params_ema", "ema", "target",
                   "optimizer/target", "opt/target")
# Top-level entries that mark a train state (as opposed to a parameter tree).
TRAIN_STATE_KEYS = frozenset({"step", "opt_state", "rngs", "optimizer", "opt", "tx"})

ORBAX_STATE_ITEM = "state"
_ORBAX_ITEM_FILES = ("_METADATA", "manifest.ocdbt", "_sharding", "checkpoint")
_STEP_DIR = re.compile(r"^(?:.*_)?(\d+)$")  # "300" (Orbax default) or "ckpt_300".
_STEP_PREFIX = re.compile(r"^(?P<base>.*)_(?P<step>\d+)\.index$")


class OrbaxNotInstalledError(CheckpointError, ImportError):
    """The checkpoint is an Orbax checkpoint but `orbax-checkpoint` is missing."""


# Local paths go through `os`, gs:// and other URLs through tf.io.gfile.
def _is_remote(path: str) -> bool:
    return "://" in path


def _gfile(path):
    try:
        from tensorflow.io import gfile
    except ImportError as error:
        raise CheckpointError(
            f"Reading the remote checkpoint {path!r} needs TensorFlow's tf.io.gfile "
            "(pip install 'keras-vmoe[tensorflow]'), or copy it to a local directory first."
        ) from error
    return gfile


def _http_fs(path: str):
    """The HTTP(S) file system for `path`, or None."""
    fs = _fs(path) if _is_remote(path) else None
    return fs if isinstance(fs, _HTTPFS) else None


def _exists(path: str) -> bool:
    if (fs := _http_fs(path)) is not None:
        return fs.exists(path)
    return _gfile(path).exists(path) if _is_remote(path) else os.path.exists(path)


def _isdir(path: str) -> bool:
    if _http_fs(path) is not None:
        return False
    return _gfile(path).isdir(path) if _is_remote(path) else os.path.isdir(path)


def _listdir(path: str) -> list[str]:
    if _http_fs(path) is not None:
        return []  # HTTP has no listing: only full checkpoint prefixes.
    names = _gfile(path).listdir(path) if _is_remote(path) else os.listdir(path)
    return sorted(name.rstrip("/") for name in names)


def _join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts) if _is_remote(parts[0]) else os.path.join(*parts)


def _dirname(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if _is_remote(path) else os.path.dirname(path)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def select_params_subtree(paths, where: str = "the checkpoint") -> str | None:
    """The subtree of a checkpoint that holds the model parameters.

    Args:
        paths: every "/"-joined leaf path of the checkpoint.
        where: how to name the checkpoint in errors.

    Returns:
        The first of `PARAMS_SUBTREES` with leaves under it, or None when the
        checkpoint is a bare parameter tree (used whole).

    Raises:
        CheckpointError: the checkpoint is a train state (it has `step`,
            `opt_state`, ... at the top) but no parameter subtree.
    """
    paths = list(paths)
    for subtree in PARAMS_SUBTREES:
        if any(p.startswith(subtree + "/") for p in paths):
            return subtree
    top = sorted({p.split("/", 1)[0] for p in paths})
    if not paths or TRAIN_STATE_KEYS.intersection(top):
        raise CheckpointError(
            f"{where} holds no model parameters: it is a train state without any "
            f"of the subtrees {list(PARAMS_SUBTREES)}. Its top-level entries are "
            f"{top}."
        )
    return None


def _strip(path: str, subtree: str | None) -> str:
    return path if subtree is None else path[len(subtree) + 1:]


@dataclasses.dataclass(frozen=True)
class ResolvedCheckpoint:
    """One checkpoint to convert, and where its parameters are.

    Attributes:
        format: "partitioned" or "orbax".
        location: the partitioned prefix, or the Orbax item directory.
        step: training step of the checkpoint (None for a params-only one).
        subtree: the subtree holding the parameters ("params", ...), or None
            for a bare parameter tree.
        available_steps: the other steps next to it (sorted).
        shapes: `{parameter path (subtree stripped): shape}`.
        dtypes: `{parameter path: numpy dtype}`.
        skipped_leaves: number of leaves outside `subtree`, not read.
    """

    format: str
    location: str
    step: int | None
    subtree: str | None
    available_steps: tuple[int, ...]
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, Any]
    skipped_leaves: int

    def describe(self) -> str:
        """One line naming the checkpoint, its step and the subtree used."""
        parts = [f"{self.format} checkpoint {redact(self.location)}"]
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.subtree is not None:
            parts.append(f"parameters from the '{self.subtree}' subtree")
        if self.skipped_leaves:
            parts.append(f"{self.skipped_leaves} other leaves (optimizer state, ...) "
                         "not read")
        return ", ".join(parts)

    def metadata(self) -> dict[str, Any]:
        """JSON-able description (recorded in a converted preset)."""
        return {
            "format": self.format,
            "location": redact(self.location),
            "step": self.step,
            "params_subtree": self.subtree,
        }

    def iter_params(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yields `(parameter path, array)`, reading only the parameters."""
        if self.format == "partitioned":
            full = [self._full(p) for p in self.shapes]
            for path, array in partitioned.iter_leaves(self.location, full):
                yield _strip(path, self.subtree), array
            return
        leaves = {self._full(p): (shape, self.dtypes[p]) for p, shape in self.shapes.items()}
        for path, array in _orbax_restore(self.location, leaves):
            yield _strip(path, self.subtree), array

    def _full(self, path: str) -> str:
        return path if self.subtree is None else f"{self.subtree}/{path}"


def _from_leaves(format_: str, location: str, step, steps, leaves, where):
    """`leaves`: `{full path: (shape, dtype name)}` of the whole checkpoint."""
    subtree = select_params_subtree(leaves, where)
    selected = {
        _strip(p, subtree): v for p, v in leaves.items()
        if subtree is None or p.startswith(subtree + "/")
    }
    return ResolvedCheckpoint(
        format=format_, location=location, step=step, subtree=subtree,
        available_steps=tuple(steps),
        shapes={p: tuple(v[0]) for p, v in selected.items()},
        dtypes={p: v[1] for p, v in selected.items()},
        skipped_leaves=len(leaves) - len(selected),
    )


def strip_index_suffix(prefix) -> str:
    """Accepts `P`, `P.index` or `P.data-00000-of-00001` for a prefix `P`."""
    prefix = os.fspath(prefix)
    if prefix.endswith(".index"):
        return prefix[: -len(".index")]
    match = re.match(r"^(.*)\.data-\d{5}-of-\d{5}$", prefix)
    return match.group(1) if match else prefix


def _partitioned_steps(base: str) -> dict[int, str]:
    """`{step: prefix}` of the trainer checkpoints `<base>_<step>.index`."""
    directory = _dirname(base) or "."
    if not _isdir(directory):
        return {}
    name = _basename(base)
    steps = {}
    for entry in _listdir(directory):
        match = _STEP_PREFIX.match(entry)
        if match and match.group("base") == name:
            steps[int(match.group("step"))] = _join(directory, entry[: -len(".index")])
    return steps


def _resolve_partitioned(prefix: str, step, steps: Mapping[int, str]) -> ResolvedCheckpoint:
    index = partitioned.read_index(prefix)
    leaves = {leaf.path_str: (leaf.shape, np.dtype(leaf.dtype)) for leaf in index.leaves}
    if step is None and "step" in leaves and leaves["step"][0] == ():
        # A train state saved without a step in its name: read the scalar.
        (_, value), = partitioned.iter_leaves(prefix, ["step"])
        step = int(value)
    resolved = _from_leaves("partitioned", prefix, step, sorted(steps), leaves,
                            f"Checkpoint {prefix!r}")
    # Checked before anything is allocated; optimizer-state shards not required.
    needed = [resolved._full(p) for p in resolved.shapes]
    partitioned.check_data_files(prefix, index, needed)
    return resolved


def _is_orbax_item(path: str) -> bool:
    return _isdir(path) and any(_exists(_join(path, f)) for f in _ORBAX_ITEM_FILES)


def _orbax_steps(root: str) -> dict[int, str]:
    """`{step: step directory}` of the finished steps of a CheckpointManager."""
    steps = {}
    for entry in _listdir(root):
        match = _STEP_DIR.match(entry)
        if match and _is_orbax_item(_join(root, entry, ORBAX_STATE_ITEM)):
            steps[int(match.group(1))] = _join(root, entry)
    return steps


def _pick_step(steps: Mapping[int, str], step, where: str) -> tuple[int, str]:
    if step is None:
        latest = max(steps)
        return latest, steps[latest]
    if step not in steps:
        raise CheckpointError(
            f"{where} has no step {step}. Available steps: {sorted(steps)}."
        )
    return step, steps[step]


def _step_of_dir(step_dir: str) -> int | None:
    match = _STEP_DIR.match(_basename(step_dir))
    return int(match.group(1)) if match else None


def _resolve_orbax(item: str, step, steps) -> ResolvedCheckpoint:
    where = f"Orbax checkpoint {item!r}"
    leaves = {p: (tuple(m.shape), np.dtype(m.dtype))
              for p, m in _flatten(_orbax_metadata(item)) if hasattr(m, "shape")}
    if step is None and leaves.get("step", (None,))[0] == ():
        # An item outside a step directory: read the scalar `step` leaf.
        step = int(next(_orbax_restore(item, {"step": leaves["step"]}))[1])
    resolved = _from_leaves("orbax", item, step, sorted(steps), leaves, where)
    _check_orbax_sizes(resolved)
    return resolved


def _check_orbax_sizes(resolved: ResolvedCheckpoint) -> None:
    """Checks the zarr chunk files and the memory needed before any restore."""
    total = 0
    for path, shape in resolved.shapes.items():
        nbytes = math.prod(shape) * np.dtype(resolved.dtypes[path]).itemsize
        total += nbytes
        name = resolved._full(path).replace("/", ".")
        zarray = _join(resolved.location, name, ".zarray")
        if not _is_remote(zarray) and os.path.isfile(zarray):
            _check_zarr_chunks(zarray, path, shape, nbytes)
    memory_budget.check_fits(
        total, f"The {len(resolved.shapes)} parameters of the Orbax checkpoint "
        f"{resolved.location!r}"
    )


def _check_zarr_chunks(zarray: str, path: str, shape, nbytes: int) -> None:
    try:
        with open(zarray, "rb") as f:
            chunks = json.loads(f.read(2**20)).get("chunks")
        expected = math.prod(-(-d // max(int(c), 1)) for d, c in zip(shape, chunks, strict=True))
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{zarray} is not a readable zarr header: {error}") from None
    folder = os.path.dirname(zarray)
    stored = sum(  # chunk files, flat ("0.0") or nested ("0/0")
        1 for _, _, names in os.walk(folder) for name in names
        if not name.startswith(".")
    )
    if stored < expected:
        raise CheckpointError(
            f"{zarray}: parameter {path!r} declares shape {tuple(shape)} "
            f"({memory_budget.format_bytes(nbytes)}) in {expected} chunks of "
            f"{tuple(chunks)}, but {folder} holds {stored} chunk file(s). The "
            "checkpoint is incomplete or its header was edited."
        )


def _import_orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:
        raise OrbaxNotInstalledError(
            "Reading an Orbax checkpoint needs the optional orbax-checkpoint "
            f"package: {ORBAX_INSTALL_COMMAND}"
        ) from error
    return ocp


def _orbax_metadata(item: str):
    """The tree of `ArrayMetadata` of an Orbax PyTree item (no array is read)."""
    ocp = _import_orbax()
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(_epath(item))
    except Exception as error:  # Orbax raises assorted types on bad dirs.
        raise CheckpointError(
            f"Cannot read the Orbax checkpoint metadata of {item!r}: {error}"
        ) from error
    finally:
        handler.close()
    return getattr(metadata, "tree", metadata)


def _epath(path: str):
    from etils import epath  # An orbax-checkpoint dependency.

    return epath.Path(path)


def _flatten(tree, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of a nested dict/list tree as `("a/0/b", leaf)`, as Orbax keys them."""
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        if tree is not None:
            yield prefix, tree
        return
    for key, value in items:
        yield from _flatten(value, f"{prefix}/{key}" if prefix else str(key))


def _orbax_restore(item: str, leaves: Mapping[str, tuple[tuple[int, ...], Any]]
                   ) -> Iterator[tuple[str, np.ndarray]]:
    """Restores only `leaves` (`{path: (shape, dtype)}`) of an Orbax item as numpy."""
    ocp = _import_orbax()
    import jax  # Orbax describes what to restore with jax.ShapeDtypeStruct.

    target = partitioned._nest((p.split("/"), jax.ShapeDtypeStruct(tuple(shape), dtype))
                               for p, (shape, dtype) in leaves.items())
    restore_args = partitioned._nest(
        (p.split("/"), ocp.RestoreArgs(restore_type=np.ndarray)) for p in leaves)
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        restored = checkpointer.restore(
            _epath(item),
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True
            ),
        )
    except Exception as error:
        raise CheckpointError(
            f"Cannot restore {len(leaves)} arrays of the Orbax checkpoint {item!r}: "
            f"{error}"
        ) from error
    finally:
        checkpointer.close()
    flat = dict(_flatten(restored))
    for path in leaves:
        yield path, np.asarray(flat.pop(path))


def _not_a_checkpoint(path: str) -> CheckpointError:
    listing = _listdir(path)
    shown = listing[:12] + (["..."] if len(listing) > 12 else [])
    return CheckpointError(
        f"{path!r} is not a checkpoint directory: expected an Orbax "
        "CheckpointManager directory (step sub-directories such as '1000/' "
        f"with a '{ORBAX_STATE_ITEM}/' item), one step directory, its "
        f"'{ORBAX_STATE_ITEM}/' item, a workdir holding 'ckpt/' or "
        "'ckpt_<step>.index' files, or a partitioned checkpoint prefix "
        f"(PREFIX for PREFIX.index). It contains: {shown}"
        + "".join(f"\nDid you mean --upstream {_join(path, name[:-len('.index')])}?"
                  for name in listing if name.endswith(".index"))
    )


def resolve_checkpoint(path, step: int | None = None) -> ResolvedCheckpoint:
    """Finds the checkpoint at `path` and its parameters (no array is loaded).

    Args:
        path: a partitioned checkpoint prefix, a trainer prefix or workdir,
            or an Orbax checkpoint directory (manager, step or item).
        step: the training step to convert (default: the latest one).

    Returns:
        A `ResolvedCheckpoint`.

    Raises:
        CheckpointError: not a checkpoint, no such step (the available ones
            are listed), no parameters, or unreadable files.
        OrbaxNotInstalledError: an Orbax checkpoint without `orbax-checkpoint`.
        ValueError: `step` is not a non-negative integer.

    Example:

    >>> checkpoint = resolve_checkpoint("workdir/ckpt")  # doctest: +SKIP
    >>> checkpoint.describe()  # doctest: +SKIP
    'orbax checkpoint workdir/ckpt/3000/state, step 3000, parameters from ...'
    """
    step = check_int(step, "step", minimum=0, allow_none=True)
    path = os.fspath(path)
    path = path.rstrip("/") or path
    prefix = strip_index_suffix(path)

    # 1. A partitioned checkpoint prefix (released weights, or one trainer step).
    if _exists(prefix + ".index"):
        base = re.sub(r"_\d+$", "", prefix)
        steps = _partitioned_steps(base) if base != prefix else {}
        own = next((s for s, p in steps.items() if p == prefix), None)
        if step is not None and step != own:
            if step not in steps:
                raise CheckpointError(
                    f"Partitioned checkpoint {prefix!r} has no step {step}. Available "
                    f"steps: {sorted(steps) or 'none (it is not a trainer checkpoint)'}."
                )
            prefix, own = steps[step], step
        return _resolve_partitioned(prefix, own, steps)

    # 2. A trainer prefix `P` with `P_<step>.index` files.
    steps = _partitioned_steps(prefix)
    if steps:
        chosen, chosen_prefix = _pick_step(steps, step, f"Checkpoint prefix {prefix!r}")
        return _resolve_partitioned(chosen_prefix, chosen, steps)

    if not _isdir(path):
        raise CheckpointError(
            f"No checkpoint at {path!r}: checkpoint index not found: neither a "
            f"partitioned checkpoint ({prefix}.index, or trainer checkpoints "
            f"{prefix}_<step>.index) nor a directory (an Orbax checkpoint or a "
            "trainer workdir) exists there. Pass a partitioned checkpoint prefix "
            "(the path without '.index' or '.data-*') or a checkpoint directory."
        )

    # 3. Orbax: an item, a step directory, or a CheckpointManager directory.
    if _is_orbax_item(path):
        step_dir = _dirname(path)
        own = _step_of_dir(step_dir)
        if step is not None and step != own:
            raise CheckpointError(
                f"{path!r} is the Orbax checkpoint of step {own}; pass its "
                f"CheckpointManager directory {_dirname(step_dir)!r} to pick step {step}."
            )
        return _resolve_orbax(path, own, {})
    if _is_orbax_item(_join(path, ORBAX_STATE_ITEM)):
        own = _step_of_dir(path)
        if step is not None and step != own:
            siblings = _orbax_steps(_dirname(path))
            chosen, step_dir = _pick_step(siblings, step, f"Orbax checkpoint {_dirname(path)!r}")
            return _resolve_orbax(_join(step_dir, ORBAX_STATE_ITEM), chosen, siblings)
        return _resolve_orbax(_join(path, ORBAX_STATE_ITEM), own, {})
    orbax_steps = _orbax_steps(path)
    if orbax_steps:
        chosen, step_dir = _pick_step(orbax_steps, step, f"Orbax checkpoint {path!r}")
        return _resolve_orbax(_join(step_dir, ORBAX_STATE_ITEM), chosen, orbax_steps)

    # 4. A workdir: its `ckpt/` manager directory or its `ckpt_<step>` prefix.
    ckpt = _join(path, "ckpt")
    if (_isdir(ckpt) and _orbax_steps(ckpt)) or _partitioned_steps(ckpt):
        return resolve_checkpoint(ckpt, step)
    raise _not_a_checkpoint(path)
