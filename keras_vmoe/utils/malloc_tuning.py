"""glibc malloc settings that make XLA:CPU faster (Linux, CPU runs).

XLA:CPU allocates every call's outputs and scratch buffers afresh, and
Linux faults in each 4 KiB page of them on first touch. MoE layers have
hundreds of MB of expert weights and weight gradients, so on CPU the page
faults and TLB misses cost as much as the arithmetic. There are two
remedies:

- **Transparent huge pages for malloc** (`glibc.malloc.hugetlb=1`,
  recommended for training: the main job and `fit` in
  `benchmarks/models.py` run faster with it; benchmarks/README.md,
  "Measurements behind the code"). glibc reads the setting only when a
  process starts, so the `keras-vmoe` compute commands, and scripts that
  call `restart_with_hugepages()` first, re-run themselves once with
  `GLIBC_TUNABLES` set. For notebooks, export
  `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` before starting the kernel.
- **`reuse_freed_memory()`** (opt-in, at runtime). It makes malloc keep and
  reuse freed buffers instead of unmapping them. It pays off in loops whose
  calls return large fresh outputs, such as a custom jitted step that
  returns the gradients (`benchmarks/soft_moe_layer.py`). `Model.fit`
  gains nothing from it, because Keras donates the weights to the train
  step, and can run slower with it (`benchmarks/models.py`). It sets three `mallopt` parameters:
  no `mmap` for allocations (`M_MMAP_MAX=0`), up to 1 GiB of freed memory
  kept at the top of the heap (`M_TRIM_THRESHOLD`), and one arena for all
  threads (`M_ARENA_MAX=1`, because thread arenas fall back to `mmap`
  above 64 MiB). The cost is that the process keeps its peak heap. Threads
  pick their arena when they first allocate, so call it before JAX runs
  anything; called later it helps less.
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


def _require_jax(feature):
    require_jax(feature, ALLOCATOR_ALTERNATIVE)


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

    Args:
        environ: the current environment (a mapping; not modified).
        platform: `sys.platform` (read when None).
        libc: `(major, minor)` glibc version (read when None).
        thp_mode: transparent huge page mode (read when None).

    Returns:
        A new dict with `GLIBC_TUNABLES` set, or None.
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

    Returns:
        bool: True when the settings are in effect (Linux with glibc),
        False where they do not apply (other platforms or C libraries);
        then nothing changed.

    Examples:

    ```python
    from keras_vmoe.utils.malloc_tuning import reuse_freed_memory

    reuse_freed_memory()  # first, before JAX runs anything
    import keras_vmoe

    model = keras_vmoe.models.ImageClassifier(
        keras_vmoe.models.VisionTransformerBackbone(
            image_size=16, patch_size=8, hidden_dim=16, num_layers=2,
            num_heads=2, mlp_dim=32, moe_layers=(1,), moe={"num_experts": 4}),
        num_classes=3)
    ```
    """
    _require_jax("keras_vmoe.utils.malloc_tuning.reuse_freed_memory")
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

    Call it first thing in a training script (before any work: the program
    starts over). It replaces the process with the same command line
    (`sys.orig_argv`) and `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. It does
    nothing, and returns, when the setting does not apply: not Linux,
    glibc < 2.35, transparent huge pages disabled, `GLIBC_TUNABLES`
    already set (for example by the restart itself), `KERAS_VMOE_NO_HUGEPAGES`
    set, or an interactive session or notebook kernel with no program to
    re-run.

    Args:
        argv: the interpreter's arguments to re-run with (what follows
            `python`), or None for this program's own (`sys.orig_argv`).
        execve: the function that replaces the process (tests pass a fake).

    Returns:
        bool: whether huge pages are in effect, when it returns.

    Examples:

    ```python
    from keras_vmoe.utils.malloc_tuning import restart_with_hugepages

    restart_with_hugepages()  # the first line of train.py
    ```
    """
    _require_jax("keras_vmoe.utils.malloc_tuning.restart_with_hugepages")
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
