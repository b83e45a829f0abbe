"""Atomic training checkpoints: the whole training state in one file.

A checkpoint is `ckpt-STEP.npz` in the checkpoint directory: every model
variable (weights, non-trainable state, the routers' and dropouts' seed
states), every optimizer variable (its step counter included), the metric
accumulators of a part-finished epoch, and a JSON record of where the run
is (epoch, step, history, timings, the run's settings).

Writes are atomic: the file is written to a temporary name, flushed to
disk (`fsync`) and renamed, and only then does `checkpoint.json` (itself
written the same way) point at it. The previous checkpoint is kept, so a
kill at any moment, or a checkpoint damaged later, leaves one to resume
from: `CheckpointStore.load` checks each file's SHA-256 and contents,
reports a damaged one with its path, and falls back to the one before.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import zipfile

import numpy as np

POINTER = "checkpoint.json"
PREFIX = "ckpt-"
SUFFIX = ".npz"
TMP_SUFFIX = ".tmp"
META_KEY = "__meta__"
FORMAT = "keras_vmoe.training_checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, or of another run)."""


def _warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_atomic(path, data):
    """Writes `data` to `path` through a temporary file, `fsync` and rename.

    `data` is bytes, or a callable that writes into the open binary file.

    On any error (disk full, read-only file system) the temporary file is
    removed and `path` is left as it was.
    """
    tmp = path + TMP_SUFFIX
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def ensure_free_space(directory, nbytes, what):
    """Raises `OSError(ENOSPC)` before writing when `directory` lacks the room.

    Some writers (HDF5) crash the process on a full disk instead of raising;
    checking first turns that into a clear error with nothing written.
    """
    import errno
    import shutil

    needed = int(nbytes * 1.05) + (1 << 20)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:  # pragma: no cover - then the write itself will tell
        return
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"Not enough disk space in {directory} for {what}: it needs about "
            f"{needed / 1e6:.1f} MB and {free / 1e6:.1f} MB are free")


def _encode(array):
    """(array to store, dtype name): extension dtypes (bfloat16) as raw bytes."""
    array = np.asarray(array)
    name = str(array.dtype)
    if array.dtype.kind not in "biufc":  # ml_dtypes' bfloat16, float8 ...
        array = array.view(f"u{array.dtype.itemsize}")
    return array, name


def _decode(array, name):
    if str(array.dtype) == name:
        return array
    import ml_dtypes  # noqa: F401  (registers bfloat16 and friends)

    return array.view(np.dtype(name))


class CheckpointStore:
    """The checkpoints of one training run in `directory`.

    Args:
        directory: str, created if missing.
        keep: int >= 2, how many checkpoints to keep (the newest ones).
    """

    def __init__(self, directory, keep=2):
        if not isinstance(keep, int) or keep < 2:
            raise ValueError(f"`keep` must be an int >= 2. Received: keep={keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep

    # -- writing ---------------------------------------------------------

    def prepare(self):
        """Creates the directory and removes temporary files left by a kill."""
        os.makedirs(self.directory, exist_ok=True)
        for leftover in glob.glob(os.path.join(self.directory, "*" + TMP_SUFFIX)):
            try:
                os.remove(leftover)
            except OSError:
                pass

    def save(self, arrays, meta):
        """Writes one checkpoint atomically; returns its path.

        Args:
            arrays: dict name -> array (the training state).
            meta: JSON-serialisable dict (must hold `global_step`).
        """
        self.prepare()
        ensure_free_space(self.directory, sum(np.asarray(a).nbytes for a in arrays.values()),
                          "a training checkpoint")
        name = f"{PREFIX}{int(meta['global_step']):010d}{SUFFIX}"
        path = os.path.join(self.directory, name)
        dtypes, stored = {}, {}
        for key, value in arrays.items():
            stored[key], dtypes[key] = _encode(value)
        record = {"format": FORMAT, **meta, "dtypes": dtypes}
        stored[META_KEY] = np.frombuffer(
            json.dumps(record).encode("utf-8"), dtype=np.uint8)
        write_atomic(path, lambda f: np.savez(f, **stored))
        entries = [e for e in self._pointer_entries() if e["file"] != name]
        entries.insert(0, {"file": name, "sha256": _sha256(path),
                           "epoch": meta.get("epoch"), "step": meta.get("step")})
        kept, dropped = entries[: self.keep], entries[self.keep:]
        write_atomic(os.path.join(self.directory, POINTER),
                     json.dumps({"checkpoints": kept}, indent=1).encode("utf-8"))
        for entry in dropped:
            try:
                os.remove(os.path.join(self.directory, entry["file"]))
            except OSError:
                pass
        return path

    # -- reading ---------------------------------------------------------

    def _pointer_entries(self):
        path = os.path.join(self.directory, POINTER)
        try:
            with open(path, "rb") as f:
                entries = json.loads(f.read().decode("utf-8"))["checkpoints"]
            return [e for e in entries
                    if isinstance(e, dict) and isinstance(e.get("file"), str)
                    and os.path.basename(e["file"]) == e["file"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as error:
            _warn(f"checkpoint index {path} is unreadable ({error}); "
                  "looking for checkpoint files instead")
            return []

    def candidates(self):
        """Checkpoint files, newest first, with their recorded SHA-256 if any."""
        entries = self._pointer_entries()
        known = {e["file"] for e in entries}
        found = sorted(os.path.basename(p) for p in glob.glob(
            os.path.join(self.directory, PREFIX + "*" + SUFFIX)))
        # Files the index does not list (an index lost in a kill) come after
        # the listed ones, newest first.
        extra = [{"file": f, "sha256": None} for f in reversed(found) if f not in known]
        return [e for e in entries if e["file"] in found] + extra

    def exists(self):
        return bool(self.candidates())

    def load(self, check=None):
        """The newest usable checkpoint as `(arrays, meta, path)`, or None.

        Damaged checkpoints (truncated, hash mismatch, unreadable) are
        reported on stderr with their path and skipped.

        Args:
            check: optional callable `(arrays, meta)` raising
                `CheckpointError` when the checkpoint does not belong to
                this run (its message is then raised, not skipped).

        Raises:
            CheckpointError: checkpoints exist but none can be read, or
                `check` refused the newest readable one.
        """
        problems = []
        for entry in self.candidates():
            path = os.path.join(self.directory, entry["file"])
            try:
                arrays, meta = self._read(path, entry.get("sha256"))
            except CheckpointError as error:
                problems.append(f"{path}: {error}")
                _warn(f"checkpoint {path} is damaged ({error}); "
                      "falling back to the previous checkpoint")
                continue
            if check is not None:
                check(arrays, meta)
            return arrays, meta, path
        if problems:
            raise CheckpointError(
                "No usable checkpoint in " + self.directory + ": "
                + "; ".join(problems)
                + ". Delete the folder (or pass overwrite=True / --overwrite) "
                "to start the run again.")
        return None

    @staticmethod
    def _read(path, sha256):
        try:
            if sha256 is not None and _sha256(path) != sha256:
                raise CheckpointError("SHA-256 differs from the one recorded at write time")
            with np.load(path, allow_pickle=False) as data:
                if META_KEY not in data.files:
                    raise CheckpointError("no run record inside")
                meta = json.loads(bytes(data[META_KEY]).decode("utf-8"))
                if meta.get("format") != FORMAT:
                    raise CheckpointError(f"unknown format {meta.get('format')!r}")
                dtypes = meta.pop("dtypes")
                arrays = {k: _decode(data[k], dtypes[k]) for k in data.files
                          if k != META_KEY}
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, EOFError,
                zipfile.BadZipFile, json.JSONDecodeError) as error:
            raise CheckpointError(f"{type(error).__name__}: {error}") from None
        return arrays, meta

    def clear(self):
        """Removes this run's checkpoint files (and the index)."""
        for entry in self.candidates():
            try:
                os.remove(os.path.join(self.directory, entry["file"]))
            except OSError:
                pass
        for name in (POINTER,):
            try:
                os.remove(os.path.join(self.directory, name))
            except OSError:
                pass
