"""`keras_vmoe.allocator.reuse_freed_memory`: freed buffers come back without page faults."""

import os
import subprocess
import sys

import pytest

from keras_vmoe import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = sys.platform == "linux" and allocator.glibc_version() is not None

# Allocates, fills and frees 256 MiB twice (as XLA:CPU does with a step's
# outputs) and prints the minor page faults of the second round.
PROBE = """
import resource, sys
import numpy as np
np._core.multiarray._set_madvise_hugepage(False)  # 4 KiB pages, as XLA's buffers
if sys.argv[1] == "reuse":
    from keras_vmoe.allocator import reuse_freed_memory
    assert reuse_freed_memory() and reuse_freed_memory()  # idempotent
def step():
    buffer = np.empty(256 * 2**20, np.uint8)
    buffer.fill(1)
    del buffer
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_freed_memory_is_reused_without_page_faults():
    default, reused = _faults("default"), _faults("reuse")
    pages = 256 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    assert default > pages // 2  # glibc unmapped the buffer: faulted in again
    assert reused < pages // 100  # the freed heap memory came back as it was


def test_reuse_freed_memory_does_nothing_off_glibc(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", False)
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.reuse_freed_memory() is False
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator, "glibc_version", lambda: None)  # musl
    assert allocator.reuse_freed_memory() is False
