"""Trainable parameters and peak training-step memory of V-MoE B/16, with and
without LoRA.

Trainable parameters are counted from the abstract model (shapes only,
nothing allocated). Memory comes from `keras_vmoe.training.memory_plan`:
XLA's memory analysis of one compiled training step (forward, backward,
Adam update) on one device, float32, for the paper's V-MoE B/16 (Every-2,
E=32, K=2) with a 1000-class head. No B/16 is built for real.

    python benchmarks/lora_memory.py --batch-size 32 > benchmarks/results/lora_memory_<date>.json
"""

import argparse
import math
import os
import platform
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from keras_vmoe.models import lora  # noqa: E402
from keras_vmoe.models.configs import abstract_weights  # noqa: E402
from keras_vmoe.models.configs import backbone_config  # noqa: E402
from keras_vmoe.models.image_classifier import ImageClassifier  # noqa: E402
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone  # noqa: E402
from keras_vmoe.training.memory_plan import memory_plan  # noqa: E402

VARIANTS = {
    "full fine-tuning": None,
    "LoRA r=8 query/value": {"rank": 8},
    "LoRA r=8 query/value + experts": {"rank": 8, "experts": True},
}


def counts(config, num_classes, settings):
    with abstract_weights():
        model = ImageClassifier(VisionTransformerBackbone(**config),
                                num_classes=num_classes, compile=False)
        if settings:
            lora.enable_lora(model, **settings)
        total = sum(math.prod(v.shape) for v in model.weights)
        trainable = sum(math.prod(v.shape) for v in model.trainable_weights)
    return int(total), int(trainable)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--no-compile", action="store_true",
                        help="parameter counts only (no XLA memory plan)")
    parser.add_argument("--quick", action="store_true",
                        help="parameter counts only (as --no-compile)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    harness.record_start(args.allow_loaded)
    if args.quick:
        args.no_compile = True
    config = backbone_config("vmoe", "B/16", images_per_group=None)
    rows = {}
    for name, settings in VARIANTS.items():
        total, trainable = counts(config, args.num_classes, settings)
        row = {"lora": settings, "parameters": total, "trainable_parameters": trainable}
        if not args.no_compile:
            plan = memory_plan(config, {"data": 1}, args.batch_size,
                               num_classes=args.num_classes, lora=settings)
            row["memory_bytes"] = plan["bytes"]
            row["peak_gib"] = round(plan["bytes"]["peak"] / 2**30, 3)
            row["measured_on"] = plan.get("measured_on")
        rows[name] = row
    return harness.write_result({
        "benchmark": "lora_memory", "model": "V-MoE B/16 every2 E=32 K=2, float32, Adam",
        "batch_size": args.batch_size, "num_classes": args.num_classes,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "keras": keras.__version__},
        "variants": rows,
    }, args.output, indent=1)


if __name__ == "__main__":
    main()
