"""Re-runs the compute commands with glibc's huge pages for malloc.

glibc reads its tunables only at start-up: see `keras_vmoe.utils.malloc_tuning`.
"""

from __future__ import annotations

import os

from keras_vmoe.utils.backend import backend
from keras_vmoe.utils.malloc_tuning import restart_with_hugepages


def reexec_with_hugepages(argv, execve=os.execve):
    """Replaces this process by `python -m keras_vmoe.cli ARGV` with huge pages.

    Returns when the setting does not apply, or the backend is not JAX.
    """
    if backend() != "jax":
        return
    restart_with_hugepages(["-m", "keras_vmoe.cli", *argv], execve=execve)
