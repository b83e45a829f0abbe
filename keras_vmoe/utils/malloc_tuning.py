"""glibc malloc settings that make XLA:CPU faster (Linux, CPU runs).

`restart_with_hugepages()` re-runs the program once with transparent huge
pages for malloc (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, read only at
start-up); `reuse_freed_memory()` makes malloc keep and reuse freed buffers.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

from keras_vmoe.utils.backend import ALLOCATOR_ALTERNATIVE
from keras_vmoe.utils.backend import require_jax

# glibc <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 1 << 30
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_ARENA_MAX, 1))

_applied = False

HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"
HUGEPAGES_OPT_OUT = "KERAS_VMOE_NO_HUGEPAGES"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)  # first glibc with the `glibc.malloc.hugetlb` tunable


def transparent_hugepage_mode(path=THP_SETTING):
    """The selected mode in `[brackets]` (`always`, `madvise`, `never`) or None."""
    try:
        with open(path, encoding="ascii") as f:
            match = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def hugepage_environment(environ, platform=None, libc=None, thp_mode=None):
    """The environment to re-run a program with huge pages, or None.

    `platform`, `libc` (`(major, minor)`) and `thp_mode` are read when None.
    """
    platform = sys.platform if platform is None else platform
    if platform != "linux" or environ.get(HUGEPAGES_OPT_OUT) or "GLIBC_TUNABLES" in environ:
        return None
    libc = glibc_version() if libc is None else libc
    if libc is None or libc < MIN_GLIBC:
        return None
    thp_mode = transparent_hugepage_mode() if thp_mode is None else thp_mode
    if thp_mode not in ("always", "madvise"):
        return None
    return {**environ, "GLIBC_TUNABLES": HUGEPAGES_TUNABLE}


def glibc_version():
    """`(major, minor)` of the running glibc, or None (musl, macOS, Windows)."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return None
    match = re.fullmatch(r"glibc (\d+)\.(\d+).*", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def reusing_freed_memory():
    """Whether `reuse_freed_memory()` is in effect in this process."""
    return _applied


def reuse_freed_memory():
    """Makes this process's malloc reuse freed memory instead of unmapping it.

    Call it before JAX runs anything; the process then keeps its peak heap.

    Returns:
        bool: whether the settings are in effect (Linux with glibc only).

    Examples:

    ```python
    from keras_vmoe.utils.malloc_tuning import reuse_freed_memory

    reuse_freed_memory()  # first, before JAX runs anything
    import keras_vmoe
    ```
    """
    require_jax("keras_vmoe.utils.malloc_tuning.reuse_freed_memory",
                ALLOCATOR_ALTERNATIVE)
    global _applied
    if _applied:
        return True
    if sys.platform != "linux" or glibc_version() is None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    return _applied


def hugepages_in_effect():
    """Whether this process started with malloc's huge-page tunable."""
    return HUGEPAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def restart_with_hugepages(argv=None, execve=os.execve):
    """Re-runs this Python program once with transparent huge pages for malloc.

    Call it first thing in a script. It returns without restarting when the
    setting does not apply (not Linux, glibc < 2.35, huge pages disabled,
    `GLIBC_TUNABLES` or `KERAS_VMOE_NO_HUGEPAGES` set, interactive session).

    `argv`: the interpreter's arguments to re-run with (default
    `sys.orig_argv`); `execve` replaces the process (tests pass a fake).

    Returns:
        bool: whether huge pages are in effect, when it returns.

    Examples:

    ```python
    from keras_vmoe.utils.malloc_tuning import restart_with_hugepages

    restart_with_hugepages()  # the first line of train.py
    ```
    """
    require_jax("keras_vmoe.utils.malloc_tuning.restart_with_hugepages",
                ALLOCATOR_ALTERNATIVE)
    environment = hugepage_environment(os.environ)
    if argv is None:
        main = sys.modules.get("__main__")
        interactive = bool(sys.flags.interactive) or not getattr(main, "__file__", None)
        argv = None if interactive else list(getattr(sys, "orig_argv", ())[1:]) or None
    if environment is None or argv is None:
        return hugepages_in_effect()
    sys.stdout.flush()
    sys.stderr.flush()
    execve(sys.executable, [sys.executable, *argv], environment)
    return True  # only a fake `execve` returns
