"""Atomic training checkpoints: the whole training state in one file.

`ckpt-STEP.npz` holds every model, optimizer and (mid-epoch) metric
variable and a JSON run record; `checkpoint.json` points at the newest.
Writes go through a temporary file, `fsync` and rename; `load` checks each
file and falls back to the previous one when it is damaged.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import sys
import zipfile
import zlib

import numpy as np

from keras_vmoe.formats.partitioned_index import CheckpointError
from keras_vmoe.utils import safe_files
from keras_vmoe.utils.validation import is_int

POINTER = "checkpoint.json"
PREFIX = "ckpt-"
SUFFIX = ".npz"
TMP_SUFFIX = ".tmp"
META_KEY = "__meta__"
FORMAT = "keras_vmoe.training_checkpoint/1"


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose contents are incomplete, non-finite or malformed."""


# What `np.savez` writes: stored (uncompressed) members. A compressed member
# is accepted only while it inflates to at most this many times its size.
_MAX_INFLATION = 4
# Bytes of a `.npy` header on top of the data.
_NPY_HEADER = 4096
_FILE_NAME = re.compile(re.escape(PREFIX) + r"[0-9]{1,20}" + re.escape(SUFFIX))
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Stored dtypes a training state can hold (no complex, object or string).
_DTYPES = frozenset(
    ["bool", "bfloat16", "float16", "float32", "float64", "float8_e4m3fn",
     "float8_e5m2"] + [f"{k}{b}" for k in ("int", "uint") for b in (8, 16, 32, 64)])


def _warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _sha256(path):
    digest = hashlib.sha256()
    with safe_files.open_regular(path, "training checkpoint", CheckpointError) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, data):
    """Writes `data` (bytes, or a callable writing into the open binary file)
    to `path` through a temporary file, `fsync` and rename; on any error
    `path` is left as it was."""
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
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def ensure_free_space(directory, nbytes, what):
    """Raises `OSError(ENOSPC)` before writing when `directory` lacks the room
    (some writers, HDF5, crash the process on a full disk)."""
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


def _checksum(array):
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def _decode(array, name):
    if not isinstance(name, str) or name not in _DTYPES:
        raise DamagedCheckpoint(f"unsupported stored dtype {name!r}")
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
        self.index_path = os.path.join(self.directory, POINTER)

    def prepare(self):
        """Creates the directory and removes temporary files left by a kill."""
        os.makedirs(self.directory, exist_ok=True)
        for leftover in glob.glob(os.path.join(self.directory, "*" + TMP_SUFFIX)):
            with contextlib.suppress(OSError):
                os.remove(leftover)

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
        dtypes, stored, checksums = {}, {}, {}
        for key, value in arrays.items():
            stored[key], dtypes[key] = _encode(value)
            checksums[key] = _checksum(stored[key])
        # Zip members' own CRCs are not always checked.
        record = {"format": FORMAT, **meta, "dtypes": dtypes, "checksums": checksums}
        stored[META_KEY] = np.frombuffer(
            json.dumps(record).encode("utf-8"), dtype=np.uint8)
        write_atomic(path, lambda f: np.savez(f, **stored))
        entries = [e for e in self._pointer_entries() if e["file"] != name]
        entries.insert(0, {"file": name, "sha256": _sha256(path),
                           "epoch": meta.get("epoch"), "step": meta.get("step")})
        kept, dropped = entries[: self.keep], entries[self.keep:]
        index = {"checkpoints": kept}
        if isinstance(meta.get("settings"), dict):
            index["settings"] = meta["settings"]
        write_atomic(self.index_path, json.dumps(index, indent=1).encode("utf-8"))
        for entry in dropped:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.directory, entry["file"]))
        return path

    def _index(self):
        """The checkpoint index's record (None: no index)."""
        if not os.path.lexists(self.index_path):
            return None
        return safe_files.read_json_file(self.index_path, "checkpoint index",
                                         CheckpointError)

    def _pointer_entries(self):
        path = self.index_path
        try:
            record = self._index() or {"checkpoints": []}
        except (CheckpointError, OSError) as error:
            if isinstance(error, CheckpointError) and os.path.exists(path) and (
                    not os.path.isfile(path)):
                # A FIFO, device or directory: nothing to fall back on safely.
                raise CheckpointError(
                    f"{error} Remove it (or pass overwrite=True / --overwrite) to "
                    "start the run again.") from None
            _warn(f"checkpoint index {path} is unreadable ({error}); "
                  "looking for checkpoint files instead")
            return []
        entries = record.get("checkpoints")
        if not isinstance(entries, list):
            _warn(f"checkpoint index {path} has no list of checkpoints; "
                  "looking for checkpoint files instead")
            return []
        valid = []
        for entry in entries:
            if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
                    and _FILE_NAME.fullmatch(entry["file"])
                    and (entry.get("sha256") is None or (
                        isinstance(entry["sha256"], str)
                        and _SHA256.fullmatch(entry["sha256"])))):
                _warn(f"checkpoint index {path} holds a malformed entry "
                      f"{_short(entry)}; ignoring it")
                continue
            valid.append(entry)
        return valid

    def recorded_settings(self):
        """The run settings the index records (None: no index or none recorded)."""
        try:
            record = self._index() or {}
        except (CheckpointError, OSError):
            return None  # `load` reports it
        settings = record.get("settings")
        return settings if isinstance(settings, dict) else None

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

    def load(self, check=None, limits=None):
        """The newest usable checkpoint as `(arrays, meta, path)`, or None.

        Damaged checkpoints are reported on stderr with their path and skipped.

        Args:
            check: optional callable `(arrays, meta, path)` raising
                `CheckpointError` (another run's: raised) or
                `DamagedCheckpoint` (incomplete: skipped).
            limits: optional dict array name -> largest number of bytes; a
                larger or unexpected array is refused before it is inflated.

        Raises:
            CheckpointError: checkpoints exist but none can be read, or
                `check` refused the newest readable one.
        """
        problems = []
        for entry in self.candidates():
            path = os.path.join(self.directory, entry["file"])
            try:
                arrays, meta = self._read(path, entry.get("sha256"), limits)
                if check is not None:
                    check(arrays, meta, path)
            except DamagedCheckpoint as error:
                problems.append(f"{path}: {error}")
                _warn(f"checkpoint {path} is damaged ({error}); "
                      "falling back to the previous checkpoint")
                continue
            return arrays, meta, path
        if problems:
            raise CheckpointError(
                "No usable checkpoint in " + self.directory + ": "
                + "; ".join(problems)
                + ". Delete the folder (or pass overwrite=True / --overwrite) "
                "to start the run again.")
        return None

    @staticmethod
    def _read(path, sha256, limits=None):
        try:
            if sha256 is not None and _sha256(path) != sha256:
                raise _ReadError("SHA-256 differs from the one recorded at write time")
            with safe_files.open_regular(path, "training checkpoint", _ReadError) as f, \
                    zipfile.ZipFile(f) as archive:
                members = {}
                for info in archive.infolist():
                    key = info.filename[:-4] if info.filename.endswith(".npy") else None
                    if key is None or key in members:
                        raise _ReadError(f"unexpected member {info.filename!r}")
                    members[key] = info
                if META_KEY not in members:
                    raise _ReadError("no run record inside")
                for key, info in members.items():
                    _check_member(key, info, limits)
                meta = json.loads(bytes(_read_member(archive, members[META_KEY]))
                                  .decode("utf-8"))
                _check_meta(meta)
                dtypes = meta.pop("dtypes")
                checksums = meta.pop("checksums")
                arrays = {}
                for key, info in members.items():
                    if key == META_KEY:
                        continue
                    raw = _read_member(archive, info)
                    if raw.dtype.kind not in "biuf":
                        raise _ReadError(f"array {key!r} holds {raw.dtype} values")
                    if _checksum(raw) != checksums.get(key):
                        raise _ReadError(f"array {key!r} fails its checksum")
                    arrays[key] = _decode(raw, dtypes.get(key))
                    if arrays[key].dtype.kind == "f" and not np.all(
                            np.isfinite(arrays[key].astype("float32"))):
                        raise _ReadError(f"array {key!r} holds NaN or infinite values")
                if set(arrays) != set(checksums):
                    raise _ReadError("arrays are missing")
        except CheckpointError as error:
            if isinstance(error, _ReadError):
                raise
            raise _ReadError(str(error)) from None
        except RecursionError:
            raise _ReadError("its run record is nested too deeply") from None
        except MemoryError:
            raise _ReadError("it does not fit in memory") from None
        except (OSError, ValueError, KeyError, TypeError, EOFError,
                zipfile.BadZipFile, json.JSONDecodeError) as error:
            raise _ReadError(f"{type(error).__name__}: {error}") from None
        return arrays, meta

    def clear(self):
        """Removes the checkpoint files the index lists, and the index."""
        path = self.index_path
        if os.path.lexists(path) and not os.path.isfile(path):
            raise CheckpointError(
                f"{path} is not a regular file, so the run's own checkpoints cannot "
                "be told from other files; remove it, then start again.")
        for entry in self._pointer_entries():
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.directory, entry["file"]))
        with contextlib.suppress(OSError):
            os.remove(self.index_path)


class _ReadError(DamagedCheckpoint):
    """A checkpoint file that cannot be read back as written."""


def _short(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_member(key, info, limits):
    """Bounds a member's inflated size before anything is read."""
    if info.compress_type != zipfile.ZIP_STORED and (
            info.file_size > _MAX_INFLATION * info.compress_size + _NPY_HEADER):
        raise _ReadError(f"array {key!r} inflates to {info.file_size} bytes from "
                         f"{info.compress_size}: not a checkpoint this library wrote")
    if key == META_KEY:
        limit = safe_files.MAX_JSON_BYTES
    elif limits is None:
        return
    elif key not in limits:
        raise _ReadError(f"array {key!r} is not a variable of this model")
    else:
        limit = limits[key]
    if info.file_size > limit + _NPY_HEADER:
        raise _ReadError(f"array {key!r} holds {info.file_size} bytes, more than the "
                         f"{limit} of the variable it restores")


def _read_member(archive, info):
    """A member's array, its declared size checked against the member's own."""
    with archive.open(info) as member:
        try:
            shape, fortran, dtype = safe_files.read_npy_header(member)
        except ValueError as error:
            raise _ReadError(f"{info.filename!r}: {error}") from error
        if dtype.hasobject:
            raise _ReadError(f"{info.filename!r} holds Python objects")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > info.file_size:
            raise _ReadError(f"{info.filename!r} declares {nbytes} bytes in a "
                             f"{info.file_size}-byte member")
        data = member.read(nbytes)
    if len(data) != nbytes:
        raise _ReadError(f"{info.filename!r} is truncated")
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape, order="F" if fortran else "C")


def _is_count(value):
    return is_int(value) and value >= 0


def _check_meta(meta):
    """Raises `_ReadError` for a run record of the wrong shape or types."""
    if not isinstance(meta, dict):
        raise _ReadError("its run record is not a JSON object")
    if meta.get("format") != FORMAT:
        raise _ReadError(f"unknown format {_short(meta.get('format'))}")
    for key in ("epoch", "step", "global_step"):
        if not _is_count(meta.get(key)):
            raise _ReadError(f"its record's {key!r} is {_short(meta.get(key))}, not an "
                             "integer >= 0")
    steps = meta.get("steps_per_epoch")
    if steps is not None:
        if not _is_count(steps) or steps < 1:
            raise _ReadError(f"its record's 'steps_per_epoch' is {_short(steps)}")
        if meta["step"] >= steps or meta["global_step"] != meta["epoch"] * steps + meta["step"]:
            raise _ReadError(
                f"its record's step {meta['step']} / global step {meta['global_step']} "
                f"do not fit epoch {meta['epoch']} of {steps} steps")
    for key, kind in (("dtypes", dict), ("checksums", dict), ("settings", dict),
                      ("history", list), ("layout", dict)):
        if key in meta and not isinstance(meta[key], kind):
            raise _ReadError(f"its record's {key!r} is a {type(meta[key]).__name__}, "
                             f"not a {kind.__name__}")
    for key in ("dtypes", "checksums"):
        if key not in meta:
            raise _ReadError(f"its record has no {key!r}")
    if not all(isinstance(e, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool)
            for v in e.values()) for e in meta.get("history", [])):
        raise _ReadError("its record's history is not a list of numbers per epoch")
    seconds = meta.get("fit_seconds", 0.0)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not (
            math.isfinite(seconds) and seconds >= 0):
        raise _ReadError(f"its record's 'fit_seconds' is {_short(seconds)}")
    for group, entries in meta.get("layout", {}).items():
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                and isinstance(e[1], list) and all(_is_count(d) for d in e[1])
                for e in entries):
            raise _ReadError(f"its record's layout of {group!r} is malformed")
