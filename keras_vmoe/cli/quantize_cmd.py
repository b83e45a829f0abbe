"""keras-vmoe quantize: a preset -> an int8 preset (W8A8 dense layers, int8-weight experts).

Examples:
  keras-vmoe quantize --preset ./keras_vmoe_finetune/preset --output ./int8_preset
  keras-vmoe quantize --preset vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012 \
    --output ./s32_int8 --probe-images 16

Kernels of the dense, attention and expert layers become int8 with float32
scales per output channel (and expert); dense and attention layers also
quantize their inputs, the experts keep float activations. The preset loads
like any other. Printed (JSON): layers quantized, weight bytes before/after,
and the logit change on a seeded probe batch of random images.
"""

import json

from keras_vmoe import presets
from keras_vmoe.cli.arguments import int_between
from keras_vmoe.cli.predict import check_preset


def add_arguments(parser):
    parser.add_argument("--preset", required=True, help="preset name or directory")
    parser.add_argument("--output", required=True, help="preset directory to write")
    parser.add_argument("--mode", choices=("int8",), default="int8",
                        help="int8 (the only mode: W8A8 dense and attention layers, "
                             "int8-weight experts)")
    parser.add_argument("--probe-images", type=int_between(1, 256), default=8,
                        help="random images (seeded, 1 to 256) on which the logit "
                             "change is reported (default 8)")
    parser.add_argument("--seed", type=int_between(0, 2**32 - 1), default=0,
                        help="probe seed (default 0)")


def run(args):
    import numpy as np

    from keras_vmoe.deploy.quantize import quantize_model  # lazy: no Keras at start-up
    from keras_vmoe.presets.save import local_directory  # lazy: no Keras at start-up

    check_preset(args.preset)
    local_directory(args.output, "keras-vmoe quantize")  # remote URLs refused early
    model = presets.from_preset(args.preset)
    size = model.backbone.image_size
    rng = np.random.default_rng(args.seed)
    images = rng.integers(0, 256, (args.probe_images, size, size, 3), dtype="uint8")
    before = np.asarray(model.predict_on_batch(images), dtype="float64")
    report = quantize_model(model, args.mode)
    after = np.asarray(model.predict_on_batch(images), dtype="float64")
    path = presets.save_to_preset(model, args.output)
    change = np.abs(after - before)
    report.update(
        output=path,
        probe={"images": args.probe_images, "seed": args.seed,
               "max_abs_logit_change": float(change.max()),
               "mean_abs_logit_change": float(change.mean()),
               "top1_agreement": float(np.mean(after.argmax(-1) == before.argmax(-1)))})
    print(json.dumps(report))
    return 0
