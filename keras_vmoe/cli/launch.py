"""keras-vmoe launch: run a script as N local JAX processes on 127.0.0.1.

Each process gets --devices-per-process virtual CPU devices and Keras'
KERAS_DISTRIBUTION_* variables; the script calls
`keras_vmoe.distribution.initialize()` first. Example:

    keras-vmoe launch --num-processes 2 --devices-per-process 4 -- python train.py

See `keras_vmoe.distribution.launch` for TPU pod hosts and GPU nodes.
"""

import argparse

from keras_vmoe.cli.arguments import int_between
from keras_vmoe.cli.arguments import positive_float as _positive_float
from keras_vmoe.distribution.launch import MAX_DEVICES_PER_PROCESS
from keras_vmoe.distribution.launch import MAX_PORT
from keras_vmoe.distribution.launch import MAX_PROCESSES
from keras_vmoe.distribution.launch import launch


def add_arguments(parser):
    parser.add_argument("--num-processes", type=int_between(1, MAX_PROCESSES),
                        default=2, help=f"local processes, 1 to {MAX_PROCESSES}")
    parser.add_argument("--devices-per-process",
                        type=int_between(1, MAX_DEVICES_PER_PROCESS), default=4,
                        help=f"virtual CPU devices each, 1 to {MAX_DEVICES_PER_PROCESS}")
    parser.add_argument("--port", type=int_between(1, MAX_PORT), default=None,
                        help="coordinator port on 127.0.0.1, 1 to 65535 (default: a "
                        "free one)")
    parser.add_argument("--timeout", type=_positive_float, default=600.0,
                        help="seconds before all processes are stopped (exit 124)")
    parser.add_argument("program", nargs=argparse.REMAINDER,
                        help="-- then the program, e.g. -- python train.py")


def run(args):
    command = list(args.program)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("no command given: keras-vmoe launch [options] -- python train.py")
    return launch(command, args.num_processes, args.devices_per_process, args.port,
                  args.timeout)
