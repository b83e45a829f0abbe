"""`benchmarks/harness.py`: the load average and CPU times recorded around
each run, and the result file refused when another job shared the machine."""

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from testing import load_benchmark as _load  # noqa: E402


@pytest.fixture
def harness(monkeypatch):
    module = _load("harness")
    monkeypatch.setattr(module, "usable_cores", lambda: 2)
    monkeypatch.setattr(module, "cpu_times", lambda: None)  # the load average decides
    return module


def _set_load(monkeypatch, *load1):
    values = iter(load1)
    monkeypatch.setattr(os, "getloadavg", lambda: (next(values), 0.5, 0.4))


def test_threshold_scales_with_the_usable_cores(harness):
    assert harness.load_threshold(2) == pytest.approx(1.5)
    assert harness.load_threshold(16) == pytest.approx(12.0)
    assert harness.load_threshold() == pytest.approx(1.5)  # 2 usable cores


def test_quiet_run_writes_the_file_with_the_load_before_and_after(
        harness, monkeypatch, tmp_path, capsys):
    _set_load(monkeypatch, 0.4, 1.1)
    harness.record_start()
    out = tmp_path / "result.json"
    harness.write_result({"benchmark": "x"}, str(out))
    written = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == written
    load = written["load"]
    assert load["before"]["load1"] == 0.4 and load["after"]["load1"] == 1.1
    assert load["quiet"] is True and load["allowed_loaded"] is False
    assert load["threshold_load1"] == pytest.approx(1.5) and load["usable_cores"] == 2


@pytest.mark.parametrize("before, after", [(2.7, 0.3), (0.3, 1.6)])
def test_loaded_run_prints_but_refuses_the_file(
        harness, monkeypatch, tmp_path, capsys, before, after):
    _set_load(monkeypatch, before, after)
    harness.record_start()
    out = tmp_path / "result.json"
    with pytest.raises(SystemExit) as raised:
        harness.write_result({"benchmark": "x"}, str(out))
    assert raised.value.code == harness.REFUSED_EXIT_STATUS
    assert not out.exists() and not (tmp_path / "result.json.tmp").exists()
    captured = capsys.readouterr()
    assert json.loads(captured.out)["load"]["quiet"] is False  # still printed
    assert "Refusing to write" in captured.err and "--allow-loaded" in captured.err
    assert f"{max(before, after):g}" in captured.err and "at most 1.5" in captured.err


def _set_cpu(harness, monkeypatch, wall_s, machine_busy_s, own_s):
    """Fake CPU times: one pair at `record_start`, one at the end."""
    values = iter([(100.0, 1.0), (100.0 + machine_busy_s, 1.0 + own_s)])
    monkeypatch.setattr(harness, "cpu_times", lambda: next(values))
    clock = iter([50.0, 50.0 + wall_s])
    monkeypatch.setattr(harness, "_now", lambda: next(clock))
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 2)


def test_own_threads_raising_the_load_do_not_refuse_a_quiet_run(
        harness, monkeypatch, tmp_path):
    # 10 s on 2 cores: the benchmark used 19 CPU-seconds, the machine 19.6.
    _set_load(monkeypatch, 0.7, 1.9)
    _set_cpu(harness, monkeypatch, 10.0, 19.6, 19.0)
    harness.record_start()
    out = tmp_path / "result.json"
    harness.write_result({"benchmark": "x"}, str(out))
    load = json.loads(out.read_text())["load"]
    assert load["quiet"] is True and load["others_cpu_share"] == pytest.approx(0.03)


def test_another_process_using_the_cpu_refuses_the_file(
        harness, monkeypatch, tmp_path, capsys):
    # 10 s on 2 cores: the benchmark used 10 CPU-seconds, something else 8.
    _set_load(monkeypatch, 0.2, 1.2)
    _set_cpu(harness, monkeypatch, 10.0, 18.0, 10.0)
    harness.record_start()
    with pytest.raises(SystemExit):
        harness.write_result({"benchmark": "x"}, str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()
    err = capsys.readouterr().err
    assert "other processes used 40%" in err and "at most 10%" in err


def test_allow_loaded_writes_the_file_and_records_it(harness, monkeypatch, tmp_path):
    _set_load(monkeypatch, 5.0, 5.0)
    harness.record_start(allow_loaded=True)
    out = tmp_path / "result.json"
    harness.write_result({"benchmark": "x"}, str(out))
    load = json.loads(out.read_text())["load"]
    assert load["quiet"] is False and load["allowed_loaded"] is True


def test_unknown_load_is_not_quiet(harness, monkeypatch, tmp_path):
    def no_load():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", no_load)
    harness.record_start()
    with pytest.raises(SystemExit):
        harness.write_result({"benchmark": "x"}, str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()


def test_without_output_nothing_is_refused(harness, monkeypatch, capsys):
    _set_load(monkeypatch, 9.0, 9.0)
    harness.record_start()
    result = harness.write_result({"benchmark": "x"})
    assert result["load"]["quiet"] is False
    assert json.loads(capsys.readouterr().out)["benchmark"] == "x"


def test_a_script_refuses_its_output_on_a_loaded_machine(monkeypatch, tmp_path):
    """Through a script's own `main` (`lora_memory --quick`: parameter counts)."""
    script = _load("lora_memory")
    from benchmarks import harness

    monkeypatch.setattr(harness, "usable_cores", lambda: 2)
    _set_load(monkeypatch, 3.0, 3.0, 3.0, 3.0)
    out = tmp_path / "lora.json"
    with pytest.raises(SystemExit) as raised:
        script.main(["--quick", "--output", str(out)])
    assert raised.value.code == harness.REFUSED_EXIT_STATUS and not out.exists()
    _set_load(monkeypatch, 3.0, 3.0)
    script.main(["--quick", "--allow-loaded", "--output", str(out)])
    assert json.loads(out.read_text())["load"]["allowed_loaded"] is True
