"""keras-vmoe presets: list the preset catalog."""

import os
import sys

FAMILIES = ("vit", "vmoe", "vmoe_15b", "soft_moe", "eee")


def add_arguments(parser):
    parser.add_argument("--family", default=None, choices=FAMILIES,
                        help="only the presets of this model family")


def run(args):
    from keras_vmoe import presets

    try:
        for name in presets.list_presets(args.family):
            print(name)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `keras-vmoe presets | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
