"""Run the same training script as several JAX processes.

Every process calls `initialize()` first; `launch` (`keras-vmoe launch`)
starts local processes with Keras' `KERAS_DISTRIBUTION_*` environment, so the
same script also runs on TPU pods, GPU nodes and under SLURM.
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
    """`XLA_FLAGS` (default: this process's) with `devices` virtual CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    kept = [f for f in flags.split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def initialize():
    """Joins this process to the multi-process run described by its environment.

    Call it before anything touches a JAX device. On a TPU pod or under SLURM
    JAX detects the cluster itself; in a single-process run it does nothing.

    Returns:
        `(process_id, num_processes)`.
    """
    import keras

    cluster = (ENV_NUM_PROCESSES, "TPU_WORKER_HOSTNAMES", "SLURM_JOB_ID",
               "OMPI_COMM_WORLD_SIZE")
    if not any(key in os.environ for key in cluster):
        return 0, 1
    require_jax("keras_vmoe.distribution.initialize (a multi-process run)",
                DISTRIBUTION_ALTERNATIVE)
    import jax

    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keras.distribution.initialize()
    return jax.process_index(), jax.process_count()


def free_port():
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command, num_processes=2, devices_per_process=4, port=None, timeout=600,
           env=None):
    """Runs `command` as `num_processes` local processes on 127.0.0.1.

    When one process fails or `timeout` seconds pass, the others are stopped.

    Args:
        command: list of strings, e.g. `[sys.executable, "train.py"]`.
        num_processes: int, 1 to 64.
        devices_per_process: int, 1 to 512.
        port: coordinator port, 1 to 65535 (default: a free one).
        timeout: seconds (finite, > 0) before every process is stopped.
        env: extra environment variables.

    Returns:
        0 when every process succeeded, else the first non-zero exit code
        (124 on timeout).
    """
    require_jax("keras_vmoe.distribution.launch", DISTRIBUTION_ALTERNATIVE)
    check_int(num_processes, "num_processes", maximum=MAX_PROCESSES)
    check_int(devices_per_process, "devices_per_process",
              maximum=MAX_DEVICES_PER_PROCESS)
    check_int(port, "port", maximum=MAX_PORT, allow_none=True)
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
