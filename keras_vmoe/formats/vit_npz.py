"""Reads the `.npz` checkpoints of google-research/vision_transformer.

`vit_jax` saves the flax parameter tree flattened with "/" keys into one `.npz`
(`gs://vit_models/...`); `keras_vmoe.conversion.infer.canonicalize` maps its
names to vmoe's. Reading is lazy: shapes come from the `.npy` headers, checked
against the stored sizes, and arrays are decoded one at a time.
"""

from __future__ import annotations

import contextlib
import math
import os
import zipfile
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from keras_vmoe.formats.filesystem import _HTTPFS
from keras_vmoe.formats.filesystem import _fs
from keras_vmoe.formats.filesystem import _remote
from keras_vmoe.formats.partitioned import CheckpointError
from keras_vmoe.utils import memory_budget
from keras_vmoe.utils import safe_files

__all__ = ["iter_arrays", "load", "read_shapes", "save"]


def _is_url(path) -> bool:
    return os.fspath(path).startswith(("http://", "https://", "gs://"))


@contextlib.contextmanager
def _open(path) -> Iterator[BinaryIO]:
    path = os.fspath(path)
    if _is_url(path):  # over HTTP(S), or gs:// through tf.io.gfile
        fs = _fs(path)
        if not fs.exists(path):
            shown = fs.url(path) if isinstance(fs, _HTTPFS) else path
            raise CheckpointError(f"ViT checkpoint not found: {shown}")
        with fs.open(path, "rb") as file:
            yield file
        return
    if not os.path.exists(path):
        raise CheckpointError(f"ViT checkpoint not found: {path}")
    with safe_files.open_regular(path, "ViT checkpoint (.npz)", CheckpointError) as file:
        yield file


def _remote_error(error):
    """The HTTP(S) error behind `error` (zipfile hides it as "not a zip file")."""
    remote = _remote()
    while error is not None:
        if isinstance(error, remote.RemoteError):
            return error
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def _zip(path) -> Iterator[zipfile.ZipFile]:
    with _open(path) as file:
        try:
            archive = zipfile.ZipFile(file)
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            behind = _remote_error(error) if _is_url(path) else None
            if behind is not None:
                raise CheckpointError(
                    f"{os.fspath(path)} cannot be read: {behind}"
                ) from behind
            raise CheckpointError(
                f"{os.fspath(path)} is not a readable .npz file ({error})."
            ) from error
        with archive:
            yield archive


def _key(member: str) -> str:
    return member[: -len(".npy")] if member.endswith(".npy") else member


def _read_header(archive, member, path):
    """`(shape, dtype)` of one `.npy` member, checked against its size and memory."""
    try:
        with archive.open(member) as entry:
            shape, _, dtype = safe_files.read_npy_header(entry)
            header = entry.tell()
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise CheckpointError(
            f"Cannot read array {member!r} of {os.fspath(path)}: {error}"
        ) from error
    shape = tuple(int(d) for d in shape)
    where = f"Array {member!r} of {os.fspath(path)}"
    if dtype.hasobject:
        raise CheckpointError(f"{where} holds Python objects ({dtype}), not numbers.")
    declared = math.prod(shape) * dtype.itemsize
    stored = archive.getinfo(member).file_size - header
    if declared > stored:
        raise CheckpointError(
            f"{where} declares shape {shape} of {dtype} "
            f"({memory_budget.format_bytes(declared)}), but the file stores only "
            f"{memory_budget.format_bytes(max(stored, 0))} for it: the file is truncated "
            "or its header was edited."
        )
    memory_budget.check_fits(declared, f"{where} (shape {shape} of {dtype})")
    return shape, dtype


def read_shapes(path) -> dict[str, tuple[int, ...]]:
    """`{key: shape}` of every array, from the (checked) `.npy` headers only."""
    with _zip(path) as archive:
        return {_key(member): _read_header(archive, member, path)[0]
                for member in archive.namelist()}


def iter_arrays(path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(key, array)` pairs one at a time, each header checked first."""
    with _zip(path) as archive:
        for member in archive.namelist():
            _read_header(archive, member, path)
            try:
                with archive.open(member) as entry:
                    array = np.lib.format.read_array(entry, allow_pickle=False)
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
                raise CheckpointError(
                    f"Cannot read array {member!r} of {os.fspath(path)}: {error}"
                ) from error
            yield _key(member), array


def load(path) -> dict[str, np.ndarray]:
    """Reads every array of a `.npz` checkpoint into a flat dict."""
    return dict(iter_arrays(path))


def save(path, params) -> None:
    """Writes a flat `{"a/b/c": array}` dict as a vit_jax style `.npz`."""
    path = os.fspath(path)
    with open(path, "wb") as file:
        np.savez(file, **{k: np.asarray(v) for k, v in params.items()})
