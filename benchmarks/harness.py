"""What every benchmark script shares: the machine's load, and writing results.

A timing taken while another job shares the cores measures that job as much
as the code (a loaded 2-core machine ran the same torch ops 100-400x slower).
So each script records, around its run, the load average and the CPU time
the whole machine spent busy (`/proc/stat`) against its own (its threads and
waited-for child processes). `write_result` refuses to write the result file
when the machine was shared: a 1-minute load above `LOAD_PER_CORE` times the
usable cores when the run starts (1.5 on 2 cores), or other processes using
more than `OTHERS_CPU_SHARE` of the machine's CPU time during the run. Where
the CPU times are unknown, the load average at the end stands in for the
second test (it also counts the benchmark's own threads, so it refuses some
quiet runs). `--allow-loaded` writes the file anyway, and the result then
says so (`load.allowed_loaded: true`), so a loaded figure can never pass for
a quiet one.

The JSON always goes to stdout; only the file is refused (exit status 3).
"""

import json
import os
import sys
import time

# A 1-minute load above this many runnable tasks per usable core means another
# job ran beside the benchmark (1.5 on 2 cores: the benchmark's own threads
# plus short bursts stay below it).
LOAD_PER_CORE = 0.75

# Other processes may use at most this share of the machine's CPU time during
# a run (system daemons, the shell) for it to count as quiet.
OTHERS_CPU_SHARE = 0.10

# The exit status of a script whose result file was refused.
REFUSED_EXIT_STATUS = 3

_started = {}


def usable_cores():
    """The cores this process may run on (its affinity), else `os.cpu_count()`."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_threshold(cores=None):
    """The highest 1-minute load average of a quiet machine with `cores`."""
    return LOAD_PER_CORE * (cores or usable_cores())


def load_average():
    """`{"load1", "load5", "load15"}` now, or None where the OS has none."""
    try:
        load1, load5, load15 = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return {"load1": round(load1, 2), "load5": round(load5, 2),
            "load15": round(load15, 2)}


def _now():
    return time.monotonic()


def cpu_times():
    """`(machine_busy_s, own_s)`: CPU seconds all cores spent busy since boot
    (`/proc/stat`: all but idle and iowait) and those of this process and its
    waited-for children; None where `/proc/stat` is missing."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    busy = (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system + own.children_user + own.children_system


def record_start(allow_loaded=False):
    """Records the load average and CPU times at the start of a run (call it
    first), and whether `--allow-loaded` was given (read by `write_result`)."""
    _started["load"] = load_average()
    _started["cpu"] = cpu_times()
    _started["wall"] = _now()
    _started["allow_loaded"] = bool(allow_loaded)
    return _started["load"]


def others_cpu_share():
    """The share of the machine's CPU time (all `os.cpu_count()` cores, over
    the run's wall time) that other processes used since `record_start`, or
    None when unknown."""
    start, end, now = _started.get("cpu"), cpu_times(), _now()
    wall = now - _started.get("wall", now)
    if start is None or end is None or wall <= 0:
        return None
    others = (end[0] - start[0]) - (end[1] - start[1])
    return round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 3)


def add_arguments(parser):
    """`--allow-loaded`: write the result file even on a shared machine."""
    parser.add_argument(
        "--allow-loaded", action="store_true",
        help="write the result file even when the load average says another "
        "job shared the machine (the result records it)")


def load_record(allow_loaded=None, before=None, after=None):
    """The `load` entry of a result: before/after, threshold, and verdict."""
    if allow_loaded is None:
        allow_loaded = _started.get("allow_loaded", False)
    before = _started.get("load") if before is None else before
    after = load_average() if after is None else after
    cores = usable_cores()
    threshold = load_threshold(cores)
    share = others_cpu_share()
    quiet_start = bool(before) and before["load1"] <= threshold
    if share is None:
        quiet_run = bool(after) and after["load1"] <= threshold
    else:
        quiet_run = share <= OTHERS_CPU_SHARE
    return {
        "before": before,
        "after": after,
        "usable_cores": cores,
        "threshold_load1": threshold,
        "others_cpu_share": share,
        "threshold_others_cpu_share": OTHERS_CPU_SHARE,
        "quiet": quiet_start and quiet_run,
        "allowed_loaded": bool(allow_loaded),
    }


def write_result(result, output=None, allow_loaded=None, indent=2):
    """Adds the `load` entry, prints the JSON, and writes `output` atomically.

    The file is refused (a message on stderr, `SystemExit(3)`) when the load
    before or after the run was above the threshold, or unknown, unless
    `allow_loaded` (default: what `record_start` was given).

    Returns:
        The result with its `load` entry.
    """
    result = dict(result)
    result["load"] = load_record(allow_loaded)
    text = json.dumps(result, indent=indent)
    print(text)
    if not output:
        return result
    load = result["load"]
    if not load["quiet"] and not load["allowed_loaded"]:
        print(
            f"Refusing to write {output}: {_describe(load)}: another job shared "
            "the machine, so the timings are not this code's. Rerun on a quiet "
            "machine, or pass --allow-loaded to write the file anyway (the "
            "result records it).",
            file=sys.stderr,
        )
        raise SystemExit(REFUSED_EXIT_STATUS)
    tmp = f"{output}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, output)
    return result


def _describe(load):
    share = load.get("others_cpu_share")
    parts = []
    for when in ("before", "after"):
        if when == "after" and share is not None:
            continue
        entry = load[when]
        parts.append(f"{entry['load1']:g} {when}" if entry else f"unknown {when}")
    text = (f"the 1-minute load average was {' and '.join(parts)} on "
            f"{load['usable_cores']} usable cores (quiet: at most "
            f"{load['threshold_load1']:g})")
    if share is not None:
        text += (f", and other processes used {share:.0%} of the machine's CPU "
                 f"time during the run (quiet: at most {load['threshold_others_cpu_share']:.0%})")
    return text
