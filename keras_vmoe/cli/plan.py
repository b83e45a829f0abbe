"""keras-vmoe plan: per-device memory of a training step on a device mesh.

Compiles one training step of PRESET with abstract weights (nothing is
allocated) on a virtual CPU mesh of the requested size and reports, per
device, the parameters, optimizer slots and gradients (computed from the
layout) and XLA's measured temporaries and peak. Example:

    keras-vmoe plan vmoe_15b --mesh expert=8 --batch 16 --images-per-group 2 --device-memory 80

A plan that does not fit `--device-memory` is compiled again with `--remat`
(rematerialised blocks) to say whether that would fit.
"""

from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.cli import emit_json
from keras_vmoe.cli import progress
from keras_vmoe.cli.arguments import int_between
from keras_vmoe.cli.arguments import positive_float as _positive_float

AXES = ("data", "expert", "model")
LAYOUTS = ("data", "expert", "expert_model", "pod")
MAX_BATCH = 2**20
MAX_AXIS = 2**16
DTYPES = ("float32", "bfloat16", "float16", "mixed_bfloat16", "mixed_float16")
# Keras optimizer names (`keras.optimizers.get`).
OPTIMIZERS = ("adafactor", "adadelta", "adagrad", "adam", "adamax", "adamw", "ftrl",
              "lion", "nadam", "rmsprop", "sgd")


def parse_mesh(text):
    """`data=2,expert=4,model=1` -> dict (an argparse `type=`)."""
    import argparse

    shape = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, sep, size = item.partition("=")
        if (not sep or axis not in AXES or not size.isdigit()
                or not 1 <= int(size) <= MAX_AXIS):
            raise argparse.ArgumentTypeError(
                f"invalid mesh item {item!r}: expected AXIS=SIZE with AXIS in "
                f"{', '.join(AXES)} and SIZE between 1 and {MAX_AXIS}, e.g. "
                "data=2,expert=4,model=1")
        if axis in shape:
            raise argparse.ArgumentTypeError(f"mesh axis {axis!r} given twice")
        shape[axis] = int(size)
    if not shape:
        raise argparse.ArgumentTypeError("empty mesh; e.g. --mesh data=2,expert=4")
    return shape


def add_arguments(parser):
    parser.add_argument("preset", help="built-in preset name, e.g. vmoe_15b")
    parser.add_argument("--mesh", type=parse_mesh, required=True,
                        help="mesh shape, e.g. data=2,expert=4,model=1 (missing axes are 1)")
    parser.add_argument("--batch", type=int_between(1, MAX_BATCH), required=True,
                        help=f"global batch size (images), 1 to {MAX_BATCH}")
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="default: expert_model if model>1, expert if expert>1, else data")
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                        help="Keras optimizer name (default adam)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="model dtype policy (default float32)")
    parser.add_argument("--device-memory", type=_positive_float, default=None,
                        metavar="GIB", help="memory per device in GiB: also say if it fits")
    parser.add_argument("--images-per-group", type=int_between(1, MAX_BATCH), default=None,
                        metavar="N", help="images per MoE routing group (default: the "
                        "preset's); the groups of a batch must split over the "
                        "data x expert devices")
    parser.add_argument("--remat", action="store_true",
                        help="rematerialise the encoder blocks (recompute their "
                        "activations in the backward pass)")
    parser.add_argument("--scan", action="store_true",
                        help="scan the repeated encoder blocks (as finetune --scan)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args):
    if resolve_preset_name(args.preset) is None:
        raise ValueError(f"Unknown preset {args.preset!r}; `keras-vmoe presets` lists "
                         "the valid names.")
    from keras_vmoe.training import memory_plan as plan  # lazy: no Keras at start-up

    progress(f"compiling one training step of {args.preset} on a virtual mesh "
             f"{args.mesh} (abstract weights; can take minutes for large models)")
    settings = dict(optimizer=args.optimizer, layout=args.layout, dtype=args.dtype,
                    images_per_group=args.images_per_group, scan=args.scan or None)
    result = plan.memory_plan(args.preset, args.mesh, args.batch, remat=args.remat or None,
                              **settings)
    if args.device_memory:
        result["device_memory_gib"] = args.device_memory
        result["fits"] = result["bytes"]["peak"] <= args.device_memory * plan.GIB
        if not result["fits"] and not result["remat"]:
            progress("it does not fit: compiling the step again with rematerialised "
                     "blocks (--remat)")
            with_remat = plan.memory_plan(args.preset, args.mesh, args.batch, remat=True,
                                          **settings)
            peak = with_remat["bytes"]["peak"]
            result["with_remat"] = {"peak": peak,
                                    "fits": peak <= args.device_memory * plan.GIB}
    if args.json:
        emit_json(result)
    else:
        print(plan.format_plan(result, args.device_memory))
    return 0
