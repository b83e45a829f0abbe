"""Re-measures the README's headline figures: the main job and the test suite.

* main job: `keras-vmoe` (= `keras-vmoe finetune`, the embedded digits, its
  default settings) once for each of `--seeds` (seed 0 exactly as the README
  prints it, the others with `--seed S`), one at a time, each into a fresh
  output folder: wall-clock time, CPU time (user + system), peak memory of
  the job (its largest process) and the test accuracy it writes in
  `metrics.json`;
* test suite: the README's test command (`pytest`, the default selection,
  two xdist workers) run `--suite-runs` times: wall-clock time and the
  number of tests that passed.

Each figure is reported per run and as median, min and max, with the machine
it ran on (CPU model, usable cores, load average before and after, Python,
JAX and Keras versions) and the commit measured, so a README sentence can
state the machine, the run count and the spread. One JSON object goes to
stdout (and `--output`); progress goes to stderr. Run it on an otherwise
idle machine: other jobs change every timing.

The README quotes the newest result file: `readme_quotes(report)` gives the
strings it must contain (`tests/test_benchmarks.py` checks them), and
`--check-main-job METRICS` is the landing guard of `.ci/run`: it fails when
a main job's `metrics.json` reports an accuracy below the README's stated
minimum (`readme_minimum_accuracy`).

Examples:

    python benchmarks/readme_figures.py                       # seeds 0-4, 1 suite run
    python benchmarks/readme_figures.py --skip-suite --seeds 0
    python benchmarks/readme_figures.py --skip-suite \
        --output benchmarks/results/2026-12-04_main_job/readme_figures.json
    python benchmarks/readme_figures.py --check-main-job keras_vmoe_finetune/metrics.json
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
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# The README sentence that states the main job's minimum accuracy (the
# landing guard reads the number from it).
MINIMUM_PATTERN = re.compile(
    r"refuses\s+a\s+change\s+whose\s+main\s+job\s+falls\s+below\s+"
    r"\*\*(\d+(?:\.\d+)?) %\*\*")


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


def git_commit(cwd=ROOT):
    """`{"commit", "dirty"}` of the checkout measured (None outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=cwd,
                                capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=cwd, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "dirty": bool(status)}


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


def measure_main_job(seeds, extra_args=()):
    """Runs the main job once per seed; per-run and summary figures."""
    results = []
    for run, seed in enumerate(seeds, 1):
        with tempfile.TemporaryDirectory() as folder:
            output = os.path.join(folder, "out")
            # Seed 0 is the default: that run is the README's command as printed.
            seed_args = ["--seed", str(seed)] if seed else []
            command = [*MAIN_JOB, "--output", output, *seed_args, *extra_args]
            _progress(f"main job run {run}/{len(seeds)}: {shlex.join(command[1:])}")
            done, wall, cpu, peak = _run_measured(command)
            if done.returncode:
                raise RuntimeError(f"The main job failed (exit {done.returncode}):\n"
                                   f"{done.stderr[-3000:]}")
            with open(os.path.join(output, "metrics.json")) as f:
                metrics = json.load(f)
        results.append({"run": run, "seed": seed, "wall_s": round(wall, 1),
                        "cpu_s": round(cpu, 1), "peak_mib": round(peak),
                        "test_accuracy": metrics["test_accuracy"],
                        "fit_s": metrics.get("fit_seconds")})
        _progress(f"  {results[-1]}")
    return {"command": "keras-vmoe " + shlex.join(list(extra_args)) if extra_args
            else "keras-vmoe", "seeds": list(seeds), "runs": results,
            "wall_s": _summary([r["wall_s"] for r in results]),
            "cpu_s": _summary([r["cpu_s"] for r in results]),
            # The largest process of any run (children's ru_maxrss is a maximum).
            "peak_mib": max(r["peak_mib"] for r in results),
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


def _percent(value):
    return f"{100 * value:.1f} %"


def _minutes(seconds):
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def readme_quotes(report):
    """The strings the README's main-job paragraph quotes from `report`.

    Returns:
        A dict: `accuracy` (seed 0's, e.g. `"98.1 %"`), `seed_range` (the
        lowest and highest over the seeds, `"97.5 % to 98.3 %"`), `seeds`
        (`"seeds 0-4"`), `wall` (median wall-clock time), `wall_range`,
        `peak` (GiB), `commit`, `cpu` and `date` (the day measured).
    """
    job = report["main_job"]
    accuracy = job["test_accuracy"]
    by_seed = {r["seed"]: r["test_accuracy"] for r in job["runs"]}
    seeds = sorted(by_seed)
    wall = job["wall_s"]
    return {
        "accuracy": _percent(by_seed.get(0, accuracy["median"])),
        "seed_range": f"{_percent(accuracy['min'])} to {_percent(accuracy['max'])}",
        "seeds": f"seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}",
        "wall": _minutes(wall["median"]),
        "wall_range": f"{_minutes(wall['min'])} to {_minutes(wall['max'])}",
        "peak": f"{job['peak_mib'] / 1024:.1f} GiB",
        "commit": (report.get("git") or {}).get("commit", "unknown"),
        "cpu": report["machine"]["cpu"],
        "date": report["date"][:10],
    }


def latest_result(results=RESULTS):
    """`(path, report)` of the newest `readme_figures.json` with a main job
    measured on a clean checkout, under `results`."""
    found = []
    for folder, _, files in os.walk(results):
        if "readme_figures.json" in files:
            path = os.path.join(folder, "readme_figures.json")
            with open(path) as f:
                report = json.load(f)
            if "main_job" in report and report.get("git"):
                found.append((report["date"], path, report))
    if not found:
        raise FileNotFoundError(f"no readme_figures.json with a main job under {results}")
    _, path, report = max(found)
    return path, report


def readme_minimum_accuracy(readme=README):
    """The minimum main-job accuracy (a fraction) the README states."""
    with open(readme, encoding="utf-8") as f:
        match = MINIMUM_PATTERN.search(f.read())
    if match is None:
        raise ValueError(f"{readme} states no minimum accuracy (no sentence matching "
                         f"{MINIMUM_PATTERN.pattern!r})")
    return float(match.group(1)) / 100


def check_main_job(metrics_path, readme=README):
    """The landing guard: 0 when the main job in `metrics_path` reached the
    README's minimum accuracy and ran all its epochs, else 1 (with a message)."""
    minimum = readme_minimum_accuracy(readme)
    with open(metrics_path) as f:
        metrics = json.load(f)
    accuracy = metrics.get("test_accuracy")
    epochs = len(metrics.get("history", {}).get("loss", []))
    if not metrics.get("completed") or epochs != metrics.get("epochs"):
        print(f"error: {metrics_path} is not a finished run ({epochs} of "
              f"{metrics.get('epochs')} epochs)", file=sys.stderr)
        return 1
    if not isinstance(accuracy, (int, float)) or not accuracy >= minimum:
        print(f"error: the main job's test accuracy is {accuracy!r}, below the "
              f"README's minimum of {_percent(minimum)} ({metrics_path}): a change "
              "to layers, numerics or training moved it; find the cause before it "
              "lands", file=sys.stderr)
        return 1
    print(f"main job: test accuracy {_percent(accuracy)} after {epochs} epochs "
          f"(README minimum {_percent(minimum)})")
    return 0


def _seeds(text):
    try:
        seeds = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated seeds (e.g. 0,1,2,3,4), got {text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"expected distinct seeds >= 0, got {text!r}")
    return seeds


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=_seeds, default=[0, 1, 2, 3, 4],
                        help="main-job seeds, one run each (default 0,1,2,3,4; "
                        "seed 0 runs the README's command as printed)")
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
    parser.add_argument("--check-main-job", metavar="METRICS", default=None,
                        help="only check a main job's metrics.json against the "
                        "README's minimum accuracy (exit 1 below it)")
    harness.add_arguments(parser)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.check_main_job:
        return check_main_job(args.check_main_job)
    harness.record_start(args.allow_loaded)
    if args.quick:
        args.skip_suite, args.seeds = True, [0]
        args.main_job_args = (args.main_job_args + " " + QUICK_MAIN_JOB_ARGS).strip()
    if args.suite_runs < 1:
        raise SystemExit("--suite-runs must be >= 1")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine(), "git": git_commit()}
    if not args.skip_main_job:
        report["main_job"] = measure_main_job(args.seeds, shlex.split(args.main_job_args))
    if not args.skip_suite:
        report["suite"] = measure_suite(args.suite_runs, shlex.split(args.pytest_args))
    report["machine"]["load_average_after"] = list(os.getloadavg())
    report["readme_sentence"] = sentence(report)
    if "main_job" in report:
        report["readme_quotes"] = readme_quotes(report)
    harness.write_result(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
