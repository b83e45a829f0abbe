"""keras-vmoe convert: upstream vmoe checkpoint -> Keras preset.

`run` is also called by `checkpoints_conversion/convert_vmoe_checkpoints.py`.
"""

from __future__ import annotations

import argparse
import sys

from keras_vmoe.conversion import infer
from keras_vmoe.conversion.infer import ConversionError
from keras_vmoe.conversion.infer import RoutingSettings
from keras_vmoe.conversion.validate import ValidationError
from keras_vmoe.formats.partitioned import CheckpointError
from keras_vmoe.formats.train_state import ResolvedCheckpoint
from keras_vmoe.formats.upstream import resolve_upstream
from keras_vmoe.formats.urls import redact

PASS_THROUGH = True


def _is_storage_error(error):
    """A `tf.errors.OpError` (storage), recognised without importing TensorFlow."""
    return any(cls.__module__.startswith("tensorflow") and cls.__name__ == "OpError"
               for cls in type(error).__mro__)


def _upstream(argv):
    for index, arg in enumerate(argv):
        if arg.startswith("--upstream="):
            return arg.split("=", 1)[1]
        if arg == "--upstream" and index + 1 < len(argv):
            return argv[index + 1]
    return "the checkpoint"


def main(argv, prog="keras-vmoe convert") -> int:
    """`run`, with a storage error (e.g. `gs://` offline) as one `error:` line."""
    try:
        return run(argv, prog=prog)
    except Exception as error:
        if not _is_storage_error(error):
            raise
        source = redact(_upstream(argv))
        detail = (str(getattr(error, "message", "") or error).strip().splitlines()
                  or [""])[0]
        hint = (" Reading gs:// needs network access to Google Cloud Storage; "
                "offline, copy the checkpoint's .index and .data-* files to a local "
                "folder and pass that prefix."
                if str(source).startswith("gs://") else "")
        print(f"error: cannot read {source} ({type(error).__name__}: {detail}).{hint}",
              file=sys.stderr)
        return 1


def _group_size(value: str):
    if value == "all":
        return "all"
    try:
        return int(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"--group-size must be an integer or 'all', got {value!r}") from error


def _capacity_factor(value: str) -> float:
    from keras_vmoe.layers import capacity  # lazy: no Keras at CLI start-up

    try:
        number = float(value)
    except ValueError:
        number = value  # validate_capacity_factor names the non-number
    try:
        return capacity.validate_capacity_factor(number, "--capacity-factor")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--capacity-factor must be a finite number > 0, got {value!r}") from None


def _image_size(value: str):
    parts = value.lower().replace("x", ",").split(",")
    try:
        sizes = [int(p) for p in parts if p]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"bad --image-size {value!r}") from error
    if len(sizes) == 1:
        return sizes[0]
    if len(sizes) == 2:
        return tuple(sizes)
    raise argparse.ArgumentTypeError(f"bad --image-size {value!r}")


def _step(value: str) -> int:
    try:
        step = int(value)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(
            f"--step must be a non-negative integer, got {value!r}")
    return step


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of the converter's command line."""
    parser = argparse.ArgumentParser(prog=prog or "keras-vmoe convert", description=(
        "Convert a google-research/vmoe checkpoint (partitioned .index/.data-* prefix, "
        "local or gs://; a checkpoint of the vmoe trainer: Orbax ckpt/ directory or "
        "ckpt_<step> prefix) or a google-research/vision_transformer .npz into a "
        "keras_vmoe preset directory."))
    parser.add_argument("--upstream", required=True,
                        help="checkpoint prefix (without .index), .npz path, or a "
                        "trainer checkpoint: Orbax directory (workdir/ckpt, "
                        "ckpt/<step> or ckpt/<step>/state; needs "
                        "keras-vmoe[orbax]), workdir/ckpt prefix or workdir")
    parser.add_argument("--step", type=_step, default=None,
                        help="training step to convert (default: the latest)")
    parser.add_argument("--output", required=True, help="preset directory to write")
    parser.add_argument("--preset", default=None,
                        help="catalog preset whose routing settings to use "
                        "(default: the preset released as --upstream, if any)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output directory")
    routing = parser.add_argument_group(
        "routing (not stored in checkpoints; overrides the preset's)")
    routing.add_argument("--router", choices=infer.ROUTER_NAMES, default=None)
    routing.add_argument("--num-selected-experts", type=int, default=None, metavar="K")
    routing.add_argument("--capacity-factor", type=_capacity_factor, default=None)
    routing.add_argument("--capacity-ceil-or-round", choices=("ceil", "round"),
                         default=None)
    routing.add_argument("--capacity-multiple-of", type=int, default=None)
    routing.add_argument("--group-size", type=_group_size, default=None,
                         help="tokens per routing group (E³: counting the copies) "
                         "or 'all'")
    routing.add_argument("--images-per-group", type=int, default=None)
    bpr = routing.add_mutually_exclusive_group()
    bpr.add_argument("--batch-priority", dest="batch_priority", action="store_true",
                     default=None, help="Batch Prioritized Routing")
    bpr.add_argument("--no-batch-priority", dest="batch_priority", action="store_false")
    routing.add_argument("--no-bf16-dispatch", dest="bfloat16_dispatch",
                         action="store_false", default=None,
                         help="do not round expert inputs/outputs to bfloat16 "
                         "(upstream's released configs do)")
    routing.add_argument("--dispatch", choices=("index", "einsum"), default=None)
    arch = parser.add_argument_group("architecture")
    arch.add_argument("--image-size", type=_image_size, default=None,
                      help="resolution to build the model at (resizes the position "
                      "embedding); default: the checkpoint's")
    arch.add_argument("--position-embedding", choices=("sincos2d", "none"),
                      default=None,
                      help="for checkpoints without a learned position embedding")
    arch.add_argument("--ensemble-size", type=int, default=None,
                      help="E³ members when the router kernel is stored 2-D")
    check = parser.add_argument_group("validation")
    check.add_argument("--validate-inputs", default=None, help="images .npy (NHWC)")
    check.add_argument("--validate-logits", default=None, help="reference logits .npy")
    check.add_argument("--atol", type=float, default=1e-4)
    return parser


def run(argv=None, prog: str | None = None) -> int:
    """Parses `argv` and converts; returns the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if (args.validate_inputs is None) != (args.validate_logits is None):
        parser.error("--validate-inputs and --validate-logits go together")
    from keras_vmoe.presets.convert import (  # lazy: `--help` answers without Keras
        convert_to_preset,
    )
    routing = {key: getattr(args, key) for key in RoutingSettings.fields()
               if getattr(args, key, None) is not None}
    try:
        source = resolve_upstream(args.upstream, args.step)
        if isinstance(source, ResolvedCheckpoint):
            print(f"Converting {source.describe()}", file=sys.stderr, flush=True)
        out = convert_to_preset(
            source, args.output, preset_name=args.preset, overwrite=args.overwrite,
            validate_inputs=args.validate_inputs, validate_logits=args.validate_logits,
            atol=args.atol, image_size=args.image_size,
            position_embedding=args.position_embedding,
            ensemble_size=args.ensemble_size, **routing)
    except (ConversionError, ValidationError, CheckpointError,
            ValueError, OSError) as error:
        print(f"error: {redact(str(error))}", file=sys.stderr)
        return 1
    except ImportError as error:
        if "pip install" not in str(error):  # not a missing optional dependency
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    step = getattr(source, "step", None)
    print(f"Wrote preset {out}" + (f" (step {step})" if step is not None else ""))
    return 0
