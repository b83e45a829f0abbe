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


def _fake_linux(monkeypatch, environ):
    monkeypatch.setattr(allocator.os, "environ", environ)
    monkeypatch.setattr(allocator, "hugepage_environment",
                        lambda env: None if "GLIBC_TUNABLES" in env
                        or env.get(allocator.HUGEPAGES_OPT_OUT)
                        else {**env, "GLIBC_TUNABLES": allocator.HUGEPAGES_TUNABLE})


def test_restart_with_hugepages_reruns_the_same_command_line(monkeypatch):
    _fake_linux(monkeypatch, {"PATH": "/bin"})
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-X", "dev", "train.py", "--epochs", "2"])
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "train.py", raising=False)
    calls = []
    assert allocator.restart_with_hugepages(execve=lambda *a: calls.append(a))
    (executable, argv, env), = calls
    assert executable == sys.executable
    assert argv == [sys.executable, "-X", "dev", "train.py", "--epochs", "2"]
    assert env["GLIBC_TUNABLES"] == allocator.HUGEPAGES_TUNABLE and env["PATH"] == "/bin"


def test_restart_with_hugepages_returns_where_it_does_not_apply(monkeypatch):
    calls = []
    execve = lambda *a: calls.append(a)  # noqa: E731
    monkeypatch.setattr(sys, "orig_argv", ["python3", "train.py"])
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "train.py", raising=False)
    # Already restarted: the tunable is in effect.
    _fake_linux(monkeypatch, {"GLIBC_TUNABLES": allocator.HUGEPAGES_TUNABLE})
    assert allocator.restart_with_hugepages(execve=execve) is True
    # Opted out, or another tunable the user set: left alone.
    _fake_linux(monkeypatch, {allocator.HUGEPAGES_OPT_OUT: "1"})
    assert allocator.restart_with_hugepages(execve=execve) is False
    _fake_linux(monkeypatch, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert allocator.restart_with_hugepages(execve=execve) is False
    # A notebook kernel or REPL has no program to re-run.
    _fake_linux(monkeypatch, {})
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    assert allocator.restart_with_hugepages(execve=execve) is False
    assert calls == []


@pytest.mark.skipif(allocator.hugepage_environment(
    {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}) is None,
    reason="huge pages do not apply on this machine")
def test_a_script_restarts_once_with_hugepages(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import os\n"
        "from keras_vmoe.allocator import restart_with_hugepages\n"
        "print('start', flush=True)\n"
        "print(restart_with_hugepages(), os.environ.get('GLIBC_TUNABLES'))\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", allocator.HUGEPAGES_OPT_OUT)}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script), "--flag"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == [
        "start", "start", f"True {allocator.HUGEPAGES_TUNABLE}"]
