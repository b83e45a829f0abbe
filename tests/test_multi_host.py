"""Two JAX processes on 127.0.0.1 (4 virtual CPU devices each, gloo) train
like one process with 8 devices. Not in the default run: `-m multi_host`."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from keras_vmoe.distribution.launch import launch
from keras_vmoe.distribution.launch import xla_flags_for_cpu_devices

pytestmark = pytest.mark.multi_host

SCRIPT = pathlib.Path(__file__).parent / "distribution_scripts" / "expert_parallel_fit.py"
ROOT = pathlib.Path(__file__).parents[1]


def _env():
    return {"PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_two_processes_match_one_process(tmp_path):
    code = launch([sys.executable, str(SCRIPT), str(tmp_path)], num_processes=2,
                  devices_per_process=4, timeout=240, env=_env())
    assert code == 0
    env = dict(os.environ, **_env(), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags_for_cpu_devices(8))
    for key in ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES",
                "KERAS_DISTRIBUTION_PROCESS_ID"):
        env.pop(key, None)
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=env, check=True,
                   timeout=240)
    single = json.loads((tmp_path / "losses_0_of_1.json").read_text())
    assert single["devices"] == 8 and len(single["losses"]) == 3
    for process_id in range(2):
        multi = json.loads((tmp_path / f"losses_{process_id}_of_2.json").read_text())
        assert multi["devices"] == 8  # the global mesh spans both processes
        np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-5)


def test_launch_reports_a_failing_process(tmp_path):
    code = launch([sys.executable, "-c", "import os, sys; "
                   "sys.exit(3 if os.environ['KERAS_DISTRIBUTION_PROCESS_ID'] == '1' else 0)"],
                  num_processes=2, devices_per_process=1, timeout=60)
    assert code == 3
