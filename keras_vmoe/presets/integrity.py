"""Checks and safe writes of preset directories.

Reading checks JSON files, the weights file, the SHA-256 hashes recorded in
`metadata.json` and the weights' shapes against `config.json`. Writing
replaces a directory so that a process killed at any point leaves the old or
the new copy (`new_temp_dir`, `replace_dir`, `recover_dir`).
"""

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings

from keras_vmoe.utils import safe_files
from keras_vmoe.utils.keras_internals import saving_lib as keras_saving_lib

logger = logging.getLogger(__name__)

WEIGHTS_HASH_KEY = "weights_sha256"
CONFIG_HASH_KEY = "config_sha256"
_HASH_BLOCK = 2**20
# Temporaries whose name holds no pid count as abandoned after this many seconds.
_ORPHAN_AGE_S = 3600
_MAX_LISTED = 5
# Largest config.json / metadata.json read (real ones are a few kB).
MAX_JSON_BYTES = 64 * 2**20
# (real path, size, mtime) -> hash of the weights files this process verified.
_VERIFIED = {}


class PresetIntegrityError(ValueError):
    """A preset directory is unreadable, corrupt or inconsistent."""


def read_json_object(path):
    """Reads a JSON file holding an object; errors name the file."""
    with safe_files.open_regular(path, "JSON file", PresetIntegrityError) as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise PresetIntegrityError(
            f"{path} is larger than {MAX_JSON_BYTES} bytes; a preset's JSON files "
            "are a few kB. It is corrupt or not a keras_vmoe file.")
    if not data.strip():
        raise PresetIntegrityError(
            f"{path} is empty (truncated download or interrupted write?).")
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise PresetIntegrityError(
            f"{path} is not valid JSON (truncated or corrupt?): {error}") from None
    except RecursionError:
        raise PresetIntegrityError(
            f"{path} is nested too deeply to be read; a preset's JSON files are "
            "a few levels deep. It is corrupt or not a keras_vmoe file.") from None
    if not isinstance(value, dict):
        raise PresetIntegrityError(
            f"{path} must hold a JSON object, but holds a {type(value).__name__}.")
    return value


def sha256_file(path):
    """Hex SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with safe_files.open_regular(path, "file to hash", PresetIntegrityError) as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def check_weights_file(path):
    """Checks that `path` is a non-empty HDF5 file (without reading it)."""
    import h5py

    if not os.path.exists(path):
        raise FileNotFoundError(f"Weights file not found: {path}")
    # A FIFO or device would block.
    safe_files.check_regular_file(path, "weights file", PresetIntegrityError)
    if os.path.getsize(path) == 0:
        raise PresetIntegrityError(
            f"{path} is empty (truncated download or interrupted write?).")
    if not h5py.is_hdf5(path):
        raise PresetIntegrityError(
            f"{path} is not an HDF5 weights file (corrupt or truncated?).")


def verify_weights_hash(path, metadata, fix_hint):
    """Checks the SHA-256 of `path` against `metadata`; `fix_hint` says what to do."""
    start_weights_hash(path, metadata, fix_hint, background=False)()


def start_weights_hash(path, metadata, fix_hint, background=True):
    """Starts `verify_weights_hash` (in a thread with `background`); returns the
    function that waits for it and raises on a mismatch."""
    expected = (metadata or {}).get(WEIGHTS_HASH_KEY)
    if not expected:
        return lambda: None
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if _VERIFIED.get(key) == expected:
        return lambda: None
    result = {}

    def run():
        try:
            result["actual"] = sha256_file(path)
        except BaseException as error:  # re-raised by `finish`
            result["error"] = error

    thread = threading.Thread(target=run, name="keras_vmoe-sha256", daemon=True)
    if background:
        thread.start()
    else:
        run()

    def finish():
        if background:
            thread.join()
        if "error" in result:
            raise result["error"]
        if result["actual"] != expected:
            raise PresetIntegrityError(
                f"{path} is corrupt: its SHA-256 is {result['actual']}, but "
                f"metadata.json records {expected}. {fix_hint}")
        _VERIFIED[key] = expected

    return finish


def record_hashes(metadata, preset_dir):
    """Adds the SHA-256 of the config and weights files to `metadata`."""
    metadata[CONFIG_HASH_KEY] = sha256_file(os.path.join(preset_dir, "config.json"))
    weights = os.path.join(preset_dir, "model.weights.h5")
    metadata[WEIGHTS_HASH_KEY] = sha256_file(weights)


def verify_config_hash(path, metadata, fix_hint):
    """Compares the SHA-256 of a `config.json` with the one `metadata` records."""
    expected = (metadata or {}).get(CONFIG_HASH_KEY)
    if not expected:
        return
    actual = sha256_file(path)
    if actual != expected:
        raise PresetIntegrityError(
            f"{path} was changed after the preset was saved: its SHA-256 is "
            f"{actual}, but metadata.json records {expected}. {fix_hint}")


def warn_unverified(preset_dir, metadata, files):
    """Warns of `files` (`{name: hash key}`) without a recorded hash; returns them."""
    metadata = metadata or {}
    unverified = sorted(name for name, key in files.items() if not metadata.get(key))
    if unverified:
        warnings.warn(
            f"The preset {preset_dir} is UNVERIFIED: its metadata.json records no "
            f"SHA-256 of {', '.join(unverified)}, so changes to these files cannot "
            "be detected. Load presets only from sources you trust; re-save it "
            "with `save_to_preset` to record the hashes.", UserWarning, stacklevel=4)
    return unverified


def stored_weight_shapes(path):
    """`{h5 dataset path: shape}` of a `.weights.h5`, without data or optimizer."""
    import h5py

    shapes = {}

    def visit(name, item):
        if isinstance(item, h5py.Dataset):
            shapes[name] = tuple(item.shape)

    try:
        with h5py.File(path, "r") as f:
            for key in f:  # the optimizer's group is not walked
                if key == "optimizer":
                    continue
                visit(key, f[key])
                if isinstance(f[key], h5py.Group):
                    f[key].visititems(lambda n, o, k=key: visit(f"{k}/{n}", o))
    except OSError as error:
        raise PresetIntegrityError(
            f"{path} cannot be read as HDF5 (corrupt or truncated?): {error}") from None
    return shapes


def expected_weight_shapes(config, model=None):
    """`{h5 dataset path: (variable path, shape)}` of an abstract build of `config`
    (or of `model`), walked as `save_weights` does; None where Keras cannot."""
    import keras

    from keras_vmoe.models.configs import (
        abstract_weights,  # lazy: integrity loads without Keras
    )

    # No public API gives the weights-file layout: a store records the walk.
    saving_lib = keras_saving_lib()
    if saving_lib is None:
        logger.debug("Cannot compute the weights layout with this Keras.")
        return None

    class _ShapeRecorder(saving_lib.H5IOStore):
        def __init__(self):
            self.shapes = {}
            self._entry = ""

        def __bool__(self):
            return True

        def make(self, path, metadata=None):
            self._entry = f"{path}/vars" if path else "vars"
            return self

        def __setitem__(self, key, value):
            self.shapes[f"{self._entry}/{key}"] = (getattr(value, "path", key),
                                                    tuple(value.shape))

    def record(model):
        optimizer = getattr(model, "optimizer", None)
        skip = {id(optimizer)} if optimizer is not None else set()
        saving_lib._save_state(model, recorder, None, "", skip)

    recorder = _ShapeRecorder()
    if model is not None:
        record(model)
        return recorder.shapes
    config = _without_compile(config)
    with abstract_weights():
        record(keras.saving.deserialize_keras_object(config))
    return recorder.shapes


def _without_compile(config):
    """`config` of a task asked not to compile (no optimizer variables)."""
    import inspect

    import keras

    cls = keras.saving.get_registered_object(str(config.get("registered_name")))
    inner = config.get("config")
    if cls is None or not isinstance(inner, dict) or (
            "compile" not in inspect.signature(cls.__init__).parameters):
        return config
    return {**config, "config": {**inner, "compile": False}}


def check_weights_match(config, config_path, weights_path, model=None):
    """Refuses a weights file that does not hold exactly the variables of `config`."""
    expected = expected_weight_shapes(config, model)
    if expected is None:
        return
    stored = stored_weight_shapes(weights_path)
    problems = []
    for key, (name, shape) in expected.items():
        if key not in stored:
            problems.append(f"{name} {shape}: missing from the weights file")
        elif stored[key] != shape:
            problems.append(
                f"{name}: shape {shape} in {os.path.basename(config_path)} but "
                f"{stored[key]} in {os.path.basename(weights_path)}")
    extra = sorted(set(stored) - set(expected))
    problems += [f"{key} {stored[key]}: not a variable of the model" for key in extra]
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED])
        more = len(problems) - _MAX_LISTED
        raise PresetIntegrityError(
            f"{config_path} does not describe the weights in {weights_path} "
            f"({len(problems)} mismatch(es): {listed}"
            + (f"; and {more} more" if more > 0 else "")
            + "). The files come from different models, or one was edited: "
            "re-download or re-convert the preset.")

_TEMP_RE = re.compile(r"^\.(?P<base>.+)\.(?P<kind>tmp|old)-(?P<rest>[^.]+)$")


def _temp_name(base, kind):
    return f".{base}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def new_temp_dir(target):
    """Creates `.<name>.tmp-<pid>-<hex>` next to `target` (errors name `target`)."""
    parent, base = os.path.split(target)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise NotADirectoryError(
            f"Cannot write {target}: {parent} is a file, not a directory.")
    try:
        os.makedirs(parent, exist_ok=True)
        path = os.path.join(parent, _temp_name(base, "tmp"))
        os.mkdir(path)
    except OSError as error:
        reason = error.strerror or str(error)
        raise type(error)(
            error.errno, f"Cannot write {target}: {reason} (in {parent})") from None
    return path


def replace_dir(src, dst):
    """Moves directory `src` to `dst`, replacing `dst` (`recover_dir` undoes a kill)."""
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return
    parent, base = os.path.split(dst)
    backup = os.path.join(parent, _temp_name(base, "old"))
    os.rename(dst, backup)
    try:
        os.rename(src, dst)
    except BaseException:
        if not os.path.lexists(dst):
            os.rename(backup, dst)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: another user's process
        pass
    return True


def _is_stale(path, rest):
    pid = rest.split("-", 1)[0]
    if pid.isdigit() and "-" in rest:
        return not _pid_alive(int(pid))
    try:
        return time.time() - os.path.getmtime(path) > _ORPHAN_AGE_S
    except OSError:
        return False


def _stale_siblings(target):
    """`(kind, path)` of the abandoned temporaries of `target`, newest first."""
    parent, base = os.path.split(target)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = []
    for name in names:
        match = _TEMP_RE.match(name)
        path = os.path.join(parent, name)
        if (match and match["base"] == base and os.path.isdir(path)
                and _is_stale(path, match["rest"])):
            found.append((os.path.getmtime(path), match["kind"], path))
    return [(kind, path) for _, kind, path in sorted(found, reverse=True)]


def recover_dir(target, is_complete):
    """Restores a missing `target` from its newest complete temporary and deletes
    abandoned ones; `is_complete(path)` says whether a copy is usable."""
    stale = _stale_siblings(target)
    restored = False
    if stale and not os.path.lexists(target):
        # Prefer the new content (tmp) to the old one, newest first.
        for _, path in sorted(stale, key=lambda item: item[0] != "tmp"):
            if is_complete(path):
                try:
                    os.rename(path, target)
                except OSError:
                    continue
                logger.warning("Restored %s from %s, left by an interrupted write.",
                               target, path)
                restored = True
                break
    for _, path in stale:
        if os.path.lexists(path):
            logger.info("Removing %s, left by an interrupted write.", path)
            shutil.rmtree(path, ignore_errors=True)
    return restored


def clean_stale_dirs(parent):
    """Recovers and cleans every `.X.tmp-*` / `.X.old-*` in the cache `parent`."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    bases = {m["base"] for m in map(_TEMP_RE.match, names) if m}
    for base in bases:
        recover_dir(os.path.join(parent, base), is_preset_complete)


def is_preset_complete(path):
    """Whether `path` holds a sound preset with its metadata."""
    return (os.path.isfile(os.path.join(path, "metadata.json"))
            and preset_problem(path) is None)


def preset_problem(path):
    """Why the preset directory `path` is unusable (files, weights hash), or None."""
    if not os.path.isdir(path):
        return f"{path} is missing"
    try:
        read_json_object(os.path.join(path, "config.json"))
        metadata_path = os.path.join(path, "metadata.json")
        metadata = (read_json_object(metadata_path)
                    if os.path.exists(metadata_path) else None)
        weights = os.path.join(path, "model.weights.h5")
        check_weights_file(weights)
        verify_weights_hash(weights, metadata, "")
    except (OSError, ValueError) as error:
        return str(error).strip()
    return None
