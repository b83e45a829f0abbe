"""The compute commands re-run themselves once with glibc's huge-page tunable."""

import os
import subprocess
import sys

import pytest

from keras_vmoe import cli
from keras_vmoe.cli import hugepages

LINUX = dict(platform="linux", libc=(2, 36), thp_mode="madvise")


def test_environment_adds_the_tunable_only_where_it_applies():
    env = hugepages.hugepage_environment({"PATH": "/bin"}, **LINUX)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert hugepages.hugepage_environment({}, **dict(LINUX, thp_mode="always"))
    # The user's own tunables are kept as they are; the opt-out is honoured.
    assert hugepages.hugepage_environment({"GLIBC_TUNABLES": "x=1"}, **LINUX) is None
    assert hugepages.hugepage_environment({hugepages.OPT_OUT: "1"}, **LINUX) is None
    # Not Linux/glibc, glibc before 2.35, or huge pages disabled: nothing.
    assert hugepages.hugepage_environment({}, **dict(LINUX, platform="darwin")) is None
    assert hugepages.hugepage_environment({}, **dict(LINUX, libc=(2, 31))) is None
    assert hugepages.hugepage_environment({}, **dict(LINUX, thp_mode="never")) is None


def test_thp_mode_is_read_from_the_bracketed_choice(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert hugepages.transparent_hugepage_mode(str(setting)) == "madvise"
    assert hugepages.transparent_hugepage_mode(str(tmp_path / "missing")) is None


def test_reexec_runs_the_same_command_with_the_tunable(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(hugepages.OPT_OUT, raising=False)
    monkeypatch.setattr(hugepages, "hugepage_environment",
                        lambda environ: {**environ, "GLIBC_TUNABLES": hugepages.TUNABLE})
    calls = []
    hugepages.reexec_with_hugepages(["predict", "x.jpg"],
                                    execve=lambda *args: calls.append(args))
    (executable, argv, env), = calls
    assert executable == sys.executable
    assert argv == [sys.executable, "-m", "keras_vmoe.cli", "predict", "x.jpg"]
    assert env["GLIBC_TUNABLES"] == hugepages.TUNABLE


def test_only_the_program_and_compute_commands_reexec(monkeypatch):
    seen = []
    monkeypatch.setattr(hugepages, "reexec_with_hugepages", seen.append)
    monkeypatch.setattr(sys, "argv", ["keras-vmoe", "presets", "--json"])
    assert cli.main() == 0  # not a compute command
    assert cli.main(["presets", "--json"]) == 0  # called from Python
    assert seen == []
    assert set(cli.COMPUTE_COMMANDS) <= set(cli.COMMANDS)


@pytest.mark.skipif(hugepages.hugepage_environment(
    {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}) is None,
    reason="huge pages do not apply on this machine")
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
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", hugepages.OPT_OUT)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), root]),
               PROBE_OUT=str(tmp_path / "out.txt"))
    done = subprocess.run(
        [sys.executable, "-m", "keras_vmoe.cli", "predict", str(tmp_path / "none.jpg")],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "error:" in done.stderr, done.stderr
    assert (tmp_path / "out.txt").read_text().split() == ["-", hugepages.TUNABLE]
