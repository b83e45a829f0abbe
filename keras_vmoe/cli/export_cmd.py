"""keras-vmoe export: a preset -> TensorFlow SavedModel or ONNX for serving.

Examples:
  keras-vmoe export --preset keras_vmoe_finetune/preset --format tf_saved_model --output served/
  keras-vmoe export --preset ./my_preset --format onnx --batch-size 8 --output m.onnx
  keras-vmoe export --preset P --format onnx --batch-size 1 --output m.onnx --capacity-factor 2
  keras-vmoe export --preset P --format onnx --batch-size 1 --output q.onnx \\
      --quantization dynamic_int8

The evaluation routing of the preset (or of the overrides given here) is
baked into the graph (with a dynamic batch, one image per routing group).
ONNX needs --batch-size. --output must be new (or an empty folder) and
outside the preset: nothing is deleted. Needs pip install "keras-vmoe[export]".
"""

import json
import os

from keras_vmoe import presets
from keras_vmoe.cli import CliError
from keras_vmoe.cli.arguments import positive_float
from keras_vmoe.cli.arguments import positive_int
from keras_vmoe.cli.predict import check_preset

FORMATS = ("tf_saved_model", "onnx")


def add_arguments(parser):
    parser.add_argument("--preset", required=True, help="preset name or directory")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--output", required=True,
                        help="SavedModel folder or .onnx file to write")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="static batch (default: dynamic for tf_saved_model; "
                             "required for onnx)")
    parser.add_argument("--capacity-factor", type=positive_float, default=None,
                        help="evaluation capacity factor to bake in")
    parser.add_argument("--images-per-group", type=positive_int, default=None,
                        help="evaluation routing group (images) to bake in")
    parser.add_argument("--no-image-bytes", action="store_true",
                        help="SavedModel without the serve_image_bytes endpoint")
    parser.add_argument("--quantization", choices=("dynamic_int8",), default=None,
                        help="onnx only: ONNX Runtime's dynamic int8 quantization "
                             "(int8 MatMul weights, integer kernels)")


def _inside(path, folder):
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output(args):
    """Refuses, before loading anything, an --output that would overwrite files."""
    output = args.output
    if not output:
        raise CliError("--output must name a new folder or .onnx file. Received ''")
    if os.path.isdir(args.preset) and (_inside(output, args.preset)
                                       or _inside(args.preset, output)):
        raise CliError(
            f"--output {output!r} is the preset {args.preset!r}, inside it or holds "
            "it; choose a folder outside the preset.")
    if os.path.islink(output) or (os.path.exists(output) and not os.path.isdir(output)):
        raise CliError(f"--output {output!r} already exists; choose a new path "
                       "(nothing is overwritten).")
    if os.path.isdir(output) and os.listdir(output):
        raise CliError(f"--output {output!r} is a folder that is not empty; choose a "
                       "new path (nothing is overwritten).")
    if args.quantization is not None and args.format != "onnx":
        raise CliError(f"--quantization {args.quantization} needs --format onnx.")
    if args.format == "onnx" and args.batch_size is None:
        raise CliError("--format onnx needs --batch-size N: the ONNX graph takes "
                       "exactly N images per call (pad smaller batches).")


def run(args):
    from keras_vmoe.deploy import export_model  # lazy: no Keras at CLI start-up
    from keras_vmoe.deploy.export import ExportError  # lazy: no Keras at CLI start-up

    check_preset(args.preset)
    check_output(args)
    routing = {k: v for k, v in (("capacity_factor", args.capacity_factor),
                                 ("images_per_group", args.images_per_group))
               if v is not None}
    model = presets.from_preset(args.preset, **routing)
    try:
        export_model(model, args.output, args.format, batch_size=args.batch_size,
                     image_bytes=not args.no_image_bytes, quantization=args.quantization)
    except ExportError as error:
        message = str(error).replace("image_bytes=False", "--no-image-bytes").replace(
            "`batch_size`", "--batch-size")
        raise CliError(message) from None
    print(json.dumps({"output": args.output, "format": args.format,
                      "batch_size": args.batch_size, "routing": routing,
                      "quantization": args.quantization}))
    return 0
