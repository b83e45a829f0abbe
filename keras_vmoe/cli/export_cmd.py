"""keras-vmoe export: a preset -> TensorFlow SavedModel or ONNX for serving.

Examples:
  keras-vmoe export --preset keras_vmoe_finetune/preset --format tf_saved_model --output served/
  keras-vmoe export --preset ./my_preset --format onnx --batch-size 8 --output m.onnx
  keras-vmoe export --preset P --format onnx --output m.onnx --capacity-factor 2

The evaluation routing of the preset (or of the overrides given here) is
baked into the graph. Needs the export extra: pip install "keras-vmoe[export]".
"""

import json

from keras_vmoe.cli.arguments import positive_float
from keras_vmoe.cli.arguments import positive_int

FORMATS = ("tf_saved_model", "onnx")


def add_arguments(parser):
    parser.add_argument("--preset", required=True, help="preset name or directory")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--output", required=True,
                        help="SavedModel folder or .onnx file to write")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="static batch (default: dynamic for tf_saved_model, 1 for onnx)")
    parser.add_argument("--capacity-factor", type=positive_float, default=None,
                        help="evaluation capacity factor to bake in")
    parser.add_argument("--images-per-group", type=positive_int, default=None,
                        help="evaluation routing group (images) to bake in")
    parser.add_argument("--no-image-bytes", action="store_true",
                        help="SavedModel without the serve_image_bytes endpoint")


def run(args):
    from keras_vmoe.cli.predict import check_preset
    from keras_vmoe.deploy import export_model
    from keras_vmoe.presets import from_preset

    check_preset(args.preset)
    routing = {k: v for k, v in (("capacity_factor", args.capacity_factor),
                                 ("images_per_group", args.images_per_group))
               if v is not None}
    model = from_preset(args.preset, **routing)
    export_model(model, args.output, args.format, batch_size=args.batch_size,
                 image_bytes=not args.no_image_bytes)
    print(json.dumps({"output": args.output, "format": args.format,
                      "batch_size": args.batch_size, "routing": routing}))
    return 0
