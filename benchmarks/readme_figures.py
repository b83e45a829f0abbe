"""Re-measures the README's headline figures: the main job and the test suite.

* main job: `keras-vmoe` (= `keras-vmoe finetune`, the embedded digits, its
  default settings) run `--main-job-runs` times, one at a time, each into a
  fresh output folder: wall-clock time, CPU time (user + system), peak
  memory of the job (its largest process) and the test accuracy it writes in
  `metrics.json`;
* test suite: the README's test command (`pytest`, the default selection,
  two xdist workers) run `--suite-runs` times: wall-clock time and the
  number of tests that passed.

Each figure is reported per run and as median, min and max, with the machine
it ran on (CPU model, usable cores, load average before and after, Python,
JAX and Keras versions), so a README sentence can state the machine, the run
count and the spread. One JSON object goes to stdout (and `--output`);
progress goes to stderr. Run it on an otherwise idle machine: other jobs
change every timing.

Examples:

    python benchmarks/readme_figures.py                       # 3 main-job runs, 1 suite run
    python benchmarks/readme_figures.py --skip-suite --main-job-runs 1
    python benchmarks/readme_figures.py --output benchmarks/results/readme_figures.json
"""

import argparse
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

# `--quick`: the main job for one epoch of 128 images (checks the script, not
# the figures).
QUICK_MAIN_JOB_ARGS = "--epochs 1 --train-split train[:128] --test-split test[:64]"
# The README's two commands (after `pip install .` / `pip install ".[tests]"`).
MAIN_JOB = [sys.executable, "-m", "keras_vmoe.cli", "finetune"]
SUITE = [sys.executable, "-m", "pytest"]


def _progress(message):
    print(f"[readme_figures] {message}", file=sys.stderr, flush=True)


def machine():
    """The machine the figures are measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    versions = {"python": platform.python_version()}
    for module in ("jax", "keras"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = None
    return {"cpu": cpu, "usable_cores": cores, "platform": platform.platform(),
            "load_average_before": list(os.getloadavg()), **versions}


def _summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": len(values)}


def _run_measured(command, env=None, cwd=ROOT):
    """Runs `command`; returns (completed process, wall s, cpu s, peak MiB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd,
                          check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # ru_maxrss of the children is the largest of any child so far (KiB on
    # Linux): exact for the first run, a lower bound of the later ones.
    peak = after.ru_maxrss / 1024
    return done, wall, cpu, peak


def measure_main_job(runs, extra_args=()):
    """Runs the main job `runs` times; per-run and summary figures."""
    results = []
    for run in range(1, runs + 1):
        with tempfile.TemporaryDirectory() as folder:
            output = os.path.join(folder, "out")
            command = [*MAIN_JOB, "--output", output, *extra_args]
            _progress(f"main job run {run}/{runs}: {shlex.join(command[1:])}")
            done, wall, cpu, peak = _run_measured(command)
            if done.returncode:
                raise RuntimeError(f"The main job failed (exit {done.returncode}):\n"
                                   f"{done.stderr[-3000:]}")
            with open(os.path.join(output, "metrics.json")) as f:
                metrics = json.load(f)
        results.append({"run": run, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                        "peak_mib": round(peak), "test_accuracy": metrics["test_accuracy"],
                        "fit_s": metrics.get("fit_seconds")})
        _progress(f"  {results[-1]}")
    return {"command": "keras-vmoe " + shlex.join(list(extra_args)) if extra_args
            else "keras-vmoe", "runs": results,
            "wall_s": _summary([r["wall_s"] for r in results]),
            "cpu_s": _summary([r["cpu_s"] for r in results]),
            "test_accuracy": _summary([r["test_accuracy"] for r in results])}


_PASSED = re.compile(r"(\d+) passed")
_FAILED = re.compile(r"(\d+) (failed|error)")


def measure_suite(runs, pytest_args=()):
    """Runs the README's test command `runs` times."""
    results = []
    env = dict(os.environ, KERAS_BACKEND="jax")
    for run in range(1, runs + 1):
        command = [*SUITE, "-p", "no:cacheprovider", *pytest_args]
        _progress(f"test suite run {run}/{runs}: pytest {shlex.join(command[3:])}")
        done, wall, cpu, _ = _run_measured(command, env=env)
        summary = (done.stdout.strip().splitlines() or [""])[-1]
        passed = _PASSED.search(summary)
        failed = _FAILED.search(summary)
        results.append({"run": run, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                        "passed": int(passed.group(1)) if passed else 0,
                        "failed": int(failed.group(1)) if failed else 0,
                        "exit_status": done.returncode, "summary": summary})
        _progress(f"  {results[-1]}")
    return {"command": "pytest " + shlex.join(list(pytest_args)), "runs": results,
            "wall_s": _summary([r["wall_s"] for r in results]),
            "passed": _summary([r["passed"] for r in results])}


def _span(summary, unit, digits=0):
    if summary["runs"] == 1 or summary["min"] == summary["max"]:
        return f"{summary['median']:.{digits}f} {unit}"
    return (f"{summary['median']:.{digits}f} {unit} (median; "
            f"{summary['min']:.{digits}f}-{summary['max']:.{digits}f})")


def sentence(report):
    """A README sentence stating the figures with machine, runs and spread."""
    host = report["machine"]
    where = f"on {host['usable_cores']} cores of {host['cpu']}"
    parts = []
    job = report.get("main_job")
    if job:
        accuracy = job["test_accuracy"]
        parts.append(
            f"main job: {_span(job['wall_s'], 's')} wall-clock, test accuracy "
            f"{_span({k: 100 * v if k != 'runs' else v for k, v in accuracy.items()}, '%', 1)}"
            f" ({job['wall_s']['runs']} run{'s' if job['wall_s']['runs'] > 1 else ''})")
    suite = report.get("suite")
    if suite:
        parts.append(
            f"test suite: {_span(suite['wall_s'], 's')} for "
            f"{int(suite['passed']['median'])} tests ({suite['wall_s']['runs']} "
            f"run{'s' if suite['wall_s']['runs'] > 1 else ''})")
    return f"Measured {where}: " + "; ".join(parts) + "."


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main-job-runs", type=int, default=3)
    parser.add_argument("--suite-runs", type=int, default=1)
    parser.add_argument("--skip-main-job", action="store_true")
    parser.add_argument("--skip-suite", action="store_true")
    parser.add_argument("--main-job-args", default="",
                        help="extra finetune arguments, e.g. '--epochs 1'")
    parser.add_argument("--pytest-args", default="",
                        help="pytest arguments (default: the README's plain `pytest`)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="one main-job run of one epoch of 128 images, no "
                        "suite (checks the script runs)")
    harness.add_arguments(parser)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    harness.record_start(args.allow_loaded)
    if args.quick:
        args.skip_suite, args.main_job_runs = True, 1
        args.main_job_args = (args.main_job_args + " " + QUICK_MAIN_JOB_ARGS).strip()
    for name in ("main_job_runs", "suite_runs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine()}
    if not args.skip_main_job:
        report["main_job"] = measure_main_job(args.main_job_runs,
                                              shlex.split(args.main_job_args))
    if not args.skip_suite:
        report["suite"] = measure_suite(args.suite_runs, shlex.split(args.pytest_args))
    report["machine"]["load_average_after"] = list(os.getloadavg())
    report["readme_sentence"] = sentence(report)
    harness.write_result(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
