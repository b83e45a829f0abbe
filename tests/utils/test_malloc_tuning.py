"""`keras_vmoe.utils.malloc_tuning`: reused freed memory, huge pages for scripts and the CLI."""

import os
import subprocess
import sys

import pytest

from keras_vmoe import cli
from keras_vmoe.cli import hugepages
from keras_vmoe.utils import malloc_tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = sys.platform == "linux" and malloc_tuning.glibc_version() is not None


HUGEPAGES_APPLY = malloc_tuning.hugepage_environment(
    {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}) is not None
needs_hugepages = pytest.mark.skipif(not HUGEPAGES_APPLY,
                                     reason="huge pages do not apply on this machine")


def _env_without_hugepages(**extra):
    """This environment minus the tunable and the opt-out, plus the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", malloc_tuning.HUGEPAGES_OPT_OUT)}
    env["PYTHONPATH"] = os.pathsep.join([*extra.pop("paths", []), ROOT,
                                         env.get("PYTHONPATH", "")])
    env.update(extra)
    return env

# Allocates, fills and frees 256 MiB twice (as XLA:CPU does with a step's
# outputs) and prints the minor page faults of the second round.
PROBE = """
import resource, sys
import numpy as np
np._core.multiarray._set_madvise_hugepage(False)  # 4 KiB pages, as XLA's buffers
if sys.argv[1] == "reuse":
    from keras_vmoe.utils.malloc_tuning import reuse_freed_memory
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
    monkeypatch.setattr(malloc_tuning, "_applied", False)
    monkeypatch.setattr(malloc_tuning.sys, "platform", "darwin")
    assert malloc_tuning.reuse_freed_memory() is False
    monkeypatch.setattr(malloc_tuning.sys, "platform", "linux")
    monkeypatch.setattr(malloc_tuning, "glibc_version", lambda: None)  # musl
    assert malloc_tuning.reuse_freed_memory() is False


def _fake_linux(monkeypatch, environ):
    monkeypatch.setattr(malloc_tuning.os, "environ", environ)
    monkeypatch.setattr(malloc_tuning, "hugepage_environment",
                        lambda env: None if "GLIBC_TUNABLES" in env
                        or env.get(malloc_tuning.HUGEPAGES_OPT_OUT)
                        else {**env, "GLIBC_TUNABLES": malloc_tuning.HUGEPAGES_TUNABLE})


def test_restart_with_hugepages_reruns_the_same_command_line(monkeypatch):
    _fake_linux(monkeypatch, {"PATH": "/bin"})
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-X", "dev", "train.py", "--epochs", "2"])
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "train.py", raising=False)
    calls = []
    assert malloc_tuning.restart_with_hugepages(execve=lambda *a: calls.append(a))
    (executable, argv, env), = calls
    assert executable == sys.executable
    assert argv == [sys.executable, "-X", "dev", "train.py", "--epochs", "2"]
    assert env["GLIBC_TUNABLES"] == malloc_tuning.HUGEPAGES_TUNABLE and env["PATH"] == "/bin"


def test_restart_with_hugepages_returns_where_it_does_not_apply(monkeypatch):
    calls = []
    execve = lambda *a: calls.append(a)  # noqa: E731
    monkeypatch.setattr(sys, "orig_argv", ["python3", "train.py"])
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "train.py", raising=False)
    # Already restarted: the tunable is in effect.
    _fake_linux(monkeypatch, {"GLIBC_TUNABLES": malloc_tuning.HUGEPAGES_TUNABLE})
    assert malloc_tuning.restart_with_hugepages(execve=execve) is True
    # Opted out, or another tunable the user set: left alone.
    _fake_linux(monkeypatch, {malloc_tuning.HUGEPAGES_OPT_OUT: "1"})
    assert malloc_tuning.restart_with_hugepages(execve=execve) is False
    _fake_linux(monkeypatch, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert malloc_tuning.restart_with_hugepages(execve=execve) is False
    # A notebook kernel or REPL has no program to re-run.
    _fake_linux(monkeypatch, {})
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    assert malloc_tuning.restart_with_hugepages(execve=execve) is False
    assert calls == []


@needs_hugepages
def test_a_script_restarts_once_with_hugepages(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import os\n"
        "from keras_vmoe.utils.malloc_tuning import restart_with_hugepages\n"
        "print('start', flush=True)\n"
        "print(restart_with_hugepages(), os.environ.get('GLIBC_TUNABLES'))\n"
    )
    done = subprocess.run([sys.executable, str(script), "--flag"],
                          env=_env_without_hugepages(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == [
        "start", "start", f"True {malloc_tuning.HUGEPAGES_TUNABLE}"]


# The CLI's compute commands (`keras_vmoe.cli.hugepages`).

LINUX = dict(platform="linux", libc=(2, 36), thp_mode="madvise")


def test_environment_adds_the_tunable_only_where_it_applies():
    env = malloc_tuning.hugepage_environment({"PATH": "/bin"}, **LINUX)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert malloc_tuning.hugepage_environment({}, **dict(LINUX, thp_mode="always"))
    # The user's own tunables are kept as they are; the opt-out is honoured.
    assert malloc_tuning.hugepage_environment({"GLIBC_TUNABLES": "x=1"}, **LINUX) is None
    assert malloc_tuning.hugepage_environment(
        {malloc_tuning.HUGEPAGES_OPT_OUT: "1"}, **LINUX) is None
    # Not Linux/glibc, glibc before 2.35, or huge pages disabled: nothing.
    assert malloc_tuning.hugepage_environment({}, **dict(LINUX, platform="darwin")) is None
    assert malloc_tuning.hugepage_environment({}, **dict(LINUX, libc=(2, 31))) is None
    assert malloc_tuning.hugepage_environment({}, **dict(LINUX, thp_mode="never")) is None


def test_thp_mode_is_read_from_the_bracketed_choice(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert malloc_tuning.transparent_hugepage_mode(str(setting)) == "madvise"
    assert malloc_tuning.transparent_hugepage_mode(str(tmp_path / "missing")) is None


def test_reexec_runs_the_same_command_with_the_tunable(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(malloc_tuning.HUGEPAGES_OPT_OUT, raising=False)
    tunable = malloc_tuning.HUGEPAGES_TUNABLE
    monkeypatch.setattr(malloc_tuning, "hugepage_environment",
                        lambda environ: {**environ, "GLIBC_TUNABLES": tunable})
    calls = []
    hugepages.reexec_with_hugepages(["predict", "x.jpg"],
                                    execve=lambda *args: calls.append(args))
    (executable, argv, env), = calls
    assert executable == sys.executable
    assert argv == [sys.executable, "-m", "keras_vmoe.cli", "predict", "x.jpg"]
    assert env["GLIBC_TUNABLES"] == malloc_tuning.HUGEPAGES_TUNABLE


def test_only_the_program_and_compute_commands_reexec(monkeypatch):
    seen = []
    monkeypatch.setattr(hugepages, "reexec_with_hugepages", seen.append)
    monkeypatch.setattr(sys, "argv", ["keras-vmoe", "presets", "--json"])
    assert cli.main() == 0  # not a compute command
    assert cli.main(["presets", "--json"]) == 0  # called from Python
    assert seen == []
    assert set(cli.COMPUTE_COMMANDS) <= set(cli.COMMANDS)


@needs_hugepages
@pytest.mark.heavy
def test_program_reexecs_into_a_process_with_the_tunable(tmp_path):
    # `predict` of a missing file is a compute command that stops before any
    # model work; the re-run process shows the tunable in its environment.
    probe = tmp_path / "sitecustomize.py"
    probe.write_text(
        "import os, sys\n"
        "if 'keras_vmoe.cli' in ' '.join(sys.argv) or sys.argv[0] == '-m':\n"
        "    open(os.environ['PROBE_OUT'], 'a').write("
        "os.environ.get('GLIBC_TUNABLES', '-') + '\\n')\n"
    )
    env = _env_without_hugepages(paths=[str(tmp_path)],
                                 PROBE_OUT=str(tmp_path / "out.txt"))
    done = subprocess.run(
        [sys.executable, "-m", "keras_vmoe.cli", "predict", str(tmp_path / "none.jpg")],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "error:" in done.stderr, done.stderr
    assert (tmp_path / "out.txt").read_text().split() == ["-", malloc_tuning.HUGEPAGES_TUNABLE]
