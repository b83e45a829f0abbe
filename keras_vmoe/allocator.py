"""Makes glibc's malloc keep and reuse freed memory (Linux, CPU runs).

XLA:CPU allocates every call's outputs afresh. glibc serves each allocation
above its mmap threshold (at most 32 MiB) with a new `mmap` and returns it
to the kernel on `free`, so a call that returns large fresh buffers faults
in zeroed 4 KiB pages again every time. A gradient function that returns an
MoE layer's weight gradients is such a call (hundreds of MB for many
experts): in `benchmarks/soft_moe_layer.py` the Soft MoE S/16 block's
`jax.value_and_grad` took 310-317 ms with glibc's defaults and 88 ms after
`reuse_freed_memory()`; in `benchmarks/moe_layer.py` the E=32 layer's took
2.5x less time (README, "Speed and memory").

It is opt-in, and worth it for loops that get large fresh outputs from
every call, such as custom JAX training loops whose jitted step returns the
gradients. `Model.fit` and the `keras-vmoe` commands gain nothing from it
(Keras donates the weights to the train step, so no large buffer is
allocated afresh); in `benchmarks/models.py` their train-step throughput
was the same or lower with it (`fit` up to 30% lower), so the CLI does not
call it.

`reuse_freed_memory()` sets three `mallopt` parameters: no `mmap` for
allocations (`M_MMAP_MAX=0`), freed memory at the top of the heap kept up to
1 GiB (`M_TRIM_THRESHOLD`), and one malloc arena for all threads
(`M_ARENA_MAX=1`; thread arenas are limited to 64 MiB heaps and would fall
back to `mmap` for larger buffers). Freed buffers are then reused without
page faults. The cost: the process keeps its peak heap instead of returning
freed memory to the kernel, and all threads share one arena.

Threads pick their arena when they first allocate, so call it before JAX
runs anything (right after the imports). Called later it helps less: the
Soft MoE block's gradient took 204 ms instead of 88 ms.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

# glibc <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 1 << 30
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_ARENA_MAX, 1))

_applied = False


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
    from keras_vmoe.allocator import reuse_freed_memory

    reuse_freed_memory()  # first, before JAX runs anything
    import keras_vmoe

    model = keras_vmoe.models.ImageClassifier(
        keras_vmoe.models.VisionTransformerBackbone(
            image_size=16, patch_size=8, hidden_dim=16, num_layers=2,
            num_heads=2, mlp_dim=32, moe_layers=(1,), moe={"num_experts": 4}),
        num_classes=3)
    ```
    """
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
