"""Opening files from users and strangers for reading, safely.

Every file the library reads goes through `open_regular` or
`check_regular_file`, which refuse FIFOs, devices and directories;
`read_json_file` adds a size bound and JSON checks.
"""

import json
import os
import stat
import tempfile

# Largest JSON file read (the library's own are at most a few MB).
MAX_JSON_BYTES = 64 * 2**20


def _refusal(path, mode, what):
    if stat.S_ISDIR(mode):
        return f"{path} is a directory, not a {what}."
    return (f"{path} is not a regular file (a FIFO, socket or device), not a "
            f"{what}; refusing to read it.")


def check_regular_file(path, what, error=ValueError):
    """Raises `error` unless `path` is a regular file (`what` names it)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"File not found: {path}") from None
    if not stat.S_ISREG(mode):
        raise error(_refusal(path, mode, what))


def open_regular(path, what, error=ValueError):
    """Opens a regular file for binary reading; raises `error` for anything else.

    Opens without blocking and checks the opened file (`fstat`), so a path
    swapped between check and open cannot get through.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"File not found: {path}") from None
    except IsADirectoryError:
        raise error(f"{path} is a directory, not a {what}.") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(_refusal(path, mode, what))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json_file(path, what, error=ValueError, max_bytes=MAX_JSON_BYTES):
    """Reads a regular file holding one JSON object (at most `max_bytes`);
    raises `error`, naming the file, for anything else."""
    with open_regular(path, what, error) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{path} is larger than {max_bytes} bytes, too large for a {what}; "
                    "it is corrupt or not a keras_vmoe file.")
    if not data.strip():
        raise error(f"{path} is empty (truncated download or interrupted write?).")
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as problem:
        raise error(f"{path} is not valid JSON (truncated or corrupt?): {problem}") from None
    except RecursionError:
        raise error(f"{path} is nested too deeply to be a {what}; it is corrupt or "
                    "not a keras_vmoe file.") from None
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, but holds a "
                    f"{type(value).__name__}.")
    return value


def read_npy_header(member):
    """`(shape, fortran_order, dtype)` of an open `.npy` stream, data unread
    (callers check the declared size before reading)."""
    import numpy as np

    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version in ((2, 0), (3, 0)):
        return np.lib.format.read_array_header_2_0(member)
    raise ValueError(f".npy version {version} is not supported")


def write_atomically(path, write):
    """Calls `write(temp_path)` on a file beside `path`, then renames it to
    `path` (created with its folder), which is returned."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temp = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temp, 0o666 & ~umask)  # mkstemp creates 0600 files
    try:
        write(temp)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
    return path
