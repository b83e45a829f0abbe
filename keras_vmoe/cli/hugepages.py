"""Runs the compute commands with glibc's transparent huge pages for malloc.

glibc reads its tunables only when a process starts, so a compute command
started as a program re-executes itself once with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (see `keras_vmoe.utils.malloc_tuning`, which
holds the checks: Linux, glibc >= 2.35, transparent huge pages not
disabled, `GLIBC_TUNABLES` not set already, `KERAS_VMOE_NO_HUGEPAGES` not
set). The main job runs faster with it (benchmarks/README.md,
"Measurements behind the code").
"""

from __future__ import annotations

import os

from keras_vmoe.utils.backend import backend
from keras_vmoe.utils.malloc_tuning import restart_with_hugepages


def reexec_with_hugepages(argv, execve=os.execve):
    """Replaces this process by `python -m keras_vmoe.cli ARGV` with huge pages.

    Returns (doing nothing) when the setting does not apply, or when the
    Keras backend is not JAX (the tuning was measured for XLA:CPU only).
    """

    if backend() != "jax":
        return
    restart_with_hugepages(["-m", "keras_vmoe.cli", *argv], execve=execve)
