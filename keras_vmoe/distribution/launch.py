"""Run the same training script as several JAX processes.

Every process calls `initialize()` first; after it, `jax.devices()` and
`keras.distribution.list_devices()` list the devices of all processes, a
`make_mesh(...)` mesh spans them, and `model.fit` takes each process's own
shard of every global batch (rows of its `data`/`expert` mesh positions).

On one machine (a test of multi-host code, or a laptop):

    keras-vmoe launch --num-processes 2 --devices-per-process 4 -- \\
        python train.py

starts 2 processes on 127.0.0.1 with 4 virtual CPU devices each and CPU
collectives through gloo. The environment it passes is Keras' own
(`KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES`,
`KERAS_DISTRIBUTION_PROCESS_ID`), so the same script runs unchanged:

* on a Cloud TPU pod slice (v4-32, v5e-64, ...): run the script on every
  host (`gcloud compute tpus tpu-vm ssh NAME --worker=all --command
  "python train.py"`); `initialize()` with no environment lets JAX find the
  coordinator and process ids from the TPU metadata;
* on GPU nodes: one process per node (all its GPUs) with
  `KERAS_DISTRIBUTION_JOB_ADDRESSES=<node-0 ip>:<port>`,
  `KERAS_DISTRIBUTION_NUM_PROCESSES=<nodes>` and
  `KERAS_DISTRIBUTION_PROCESS_ID=<node rank>` set by your scheduler (e.g.
  from `SLURM_PROCID`), or under SLURM nothing at all (JAX reads SLURM's
  variables).
"""

import math
import os
import socket
import subprocess
import time

from keras_vmoe.utils.backend import DISTRIBUTION_ALTERNATIVE
from keras_vmoe.utils.backend import require_jax
from keras_vmoe.utils.validation import check_int

ENV_ADDRESS = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
ENV_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
ENV_PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"
# Limits of `launch` (and of `keras-vmoe launch`, which parses them).
MAX_PROCESSES = 64
MAX_DEVICES_PER_PROCESS = 512
MAX_PORT = 65535


def xla_flags_for_cpu_devices(devices, flags=None):
    """`XLA_FLAGS` for a process with `devices` virtual CPU devices.

    Args:
        devices: int, the number of virtual CPU devices.
        flags: str, the flags to start from (default: this process's
            `XLA_FLAGS`); their own device count, if any, is replaced and
            the other flags are kept.

    Returns:
        The flags, as one string.
    """
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    kept = [f for f in flags.split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])

def initialize():
    """Joins this process to the multi-process run described by its environment.

    Call it at the top of a training script, before anything touches a JAX
    device. Without `KERAS_DISTRIBUTION_*` variables on a TPU pod or under
    SLURM, JAX detects the cluster itself; with none of these (a plain
    single-process run) it does nothing.

    Returns:
        `(process_id, num_processes)`.
    """
    import keras

    if ENV_NUM_PROCESSES not in os.environ and not _cluster_detected():
        return 0, 1
    _require_jax("keras_vmoe.distribution.initialize (a multi-process run)")
    import jax

    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        # CPU collectives between processes: Keras has no setting for this.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keras.distribution.initialize()
    return jax.process_index(), jax.process_count()


def _require_jax(feature):
    require_jax(feature, DISTRIBUTION_ALTERNATIVE)


def _cluster_detected():
    return any(key in os.environ for key in ("TPU_WORKER_HOSTNAMES", "SLURM_JOB_ID",
                                             "OMPI_COMM_WORLD_SIZE"))


def free_port():
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command, num_processes=2, devices_per_process=4, port=None, timeout=600,
           env=None):
    """Runs `command` as `num_processes` local processes on 127.0.0.1.

    Each process gets `devices_per_process` virtual CPU devices and the
    `KERAS_DISTRIBUTION_*` variables `initialize()` reads. When one process
    fails or `timeout` seconds pass, the others are stopped.

    Args:
        command: list of strings, e.g. `[sys.executable, "train.py"]`.
        num_processes: int, 1 to 64.
        devices_per_process: int, 1 to 512.
        port: coordinator port on 127.0.0.1, 1 to 65535 (default: a free
            one).
        timeout: seconds (finite, > 0) before every process is stopped.
        env: extra environment variables.

    Returns:
        0 when every process succeeded, else the first non-zero exit code
        (124 on timeout).
    """
    _require_jax("keras_vmoe.distribution.launch")

    for name, value, high in (
        ("num_processes", num_processes, MAX_PROCESSES),
        ("devices_per_process", devices_per_process, MAX_DEVICES_PER_PROCESS),
        ("port", port, MAX_PORT),
    ):
        if name == "port" and value is None:
            continue
        check_int(value, name, maximum=high)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
        math.isfinite(timeout) and timeout > 0
    ):
        raise ValueError(f"`timeout` must be a finite number > 0. Received: {timeout!r}")
    if not command:
        raise ValueError("`command` is empty: give the program to run, e.g. python train.py")
    port = port or free_port()
    processes = []
    for process_id in range(num_processes):
        child = dict(os.environ, **(env or {}))
        child.update({
            "XLA_FLAGS": xla_flags_for_cpu_devices(devices_per_process,
                                                   child.get("XLA_FLAGS", "")),
            "JAX_PLATFORMS": "cpu",
            "KERAS_BACKEND": "jax",
            ENV_ADDRESS: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(process_id),
        })
        processes.append(subprocess.Popen(list(command), env=child))
    deadline = time.monotonic() + timeout
    code = 0
    try:
        while any(p.poll() is None for p in processes):
            failed = [p.returncode for p in processes if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                code = failed[0] if failed else 124
                break
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.poll() is None:
                p.terminate()
        for p in processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return code or next((p.returncode for p in processes if p.returncode), 0)

