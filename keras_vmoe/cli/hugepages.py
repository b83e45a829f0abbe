"""Runs the compute commands with glibc's transparent huge pages for malloc.

XLA:CPU allocates every call's output and scratch buffers afresh. Without
huge pages, Linux faults in each 4 KiB page of them on first touch, and
streaming hundreds of MB of expert weights takes one TLB miss per 4 KiB.
On the machine of `benchmarks/results/`, a 134 MB elementwise op took 80 ms
with 4 KiB pages and 20 ms with glibc's `glibc.malloc.hugetlb=1` tunable
(malloc asks the kernel for transparent huge pages), and the E=32 MoE
layer's forward+backward took 200 ms against 304-348 ms (README, "Speed
and memory").

glibc reads its tunables only when a process starts, so the command
re-executes itself once with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. It
does so only on Linux with glibc >= 2.35 when transparent huge pages are
not disabled, when `GLIBC_TUNABLES` is not set already (the user's value is
kept as it is) and `KERAS_VMOE_NO_HUGEPAGES` is not set. Python users get
the same by exporting the variable before starting Python.
"""

from __future__ import annotations

import os
import re
import sys

from keras_vmoe.allocator import glibc_version

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "KERAS_VMOE_NO_HUGEPAGES"
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
    """The environment to re-run the command with, or None to leave it alone.

    Args:
        environ: the current environment (a mapping; not modified).
        platform: `sys.platform` (read when None).
        libc: `(major, minor)` glibc version (read when None).
        thp_mode: transparent huge page mode (read when None).

    Returns:
        A new dict with `GLIBC_TUNABLES` set, or None.
    """
    platform = sys.platform if platform is None else platform
    if platform != "linux" or environ.get(OPT_OUT) or "GLIBC_TUNABLES" in environ:
        return None
    libc = glibc_version() if libc is None else libc
    if libc is None or libc < MIN_GLIBC:
        return None
    thp_mode = transparent_hugepage_mode() if thp_mode is None else thp_mode
    if thp_mode not in ("always", "madvise"):
        return None
    return {**environ, "GLIBC_TUNABLES": TUNABLE}


def reexec_with_hugepages(argv, execve=os.execve):
    """Replaces this process by `python -m keras_vmoe.cli ARGV` with huge pages.

    Returns (doing nothing) when `hugepage_environment` says no.
    """
    environment = hugepage_environment(os.environ)
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    execve(sys.executable, [sys.executable, "-m", "keras_vmoe.cli", *argv], environment)
