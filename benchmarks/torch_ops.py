"""Which PyTorch ops the eager forward of a V-MoE runs, and how many (counts).

Counts do not depend on the machine's load, unlike eager timings: they show
where an eager step's dispatch overhead goes (ops on the routing/dispatch
path such as `take_along_dim`, `gather`, `remainder`, `where`). Runs one
`predict_on_batch`-equivalent forward (`model(x, training=False)`) and one
training forward under `torch.profiler` and reports each op's call count,
the total, and the shapes of the most-called ops.

    KERAS_BACKEND=torch python benchmarks/torch_ops.py --output ops.json
    KERAS_BACKEND=torch python benchmarks/torch_ops.py --quick
"""

import argparse
import collections
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from benchmarks.train_step import NUM_CLASSES  # noqa: E402
from benchmarks.train_step import QUICK  # noqa: E402
from benchmarks.train_step import TINY  # noqa: E402


def op_counts(fn):
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as profile:
        fn()
    counts = collections.Counter()
    shapes = collections.Counter()
    for event in profile.events():
        if event.name.startswith("aten::") and event.cpu_parent is None:
            counts[event.name] += 1
            shapes[(event.name, str(event.input_shapes))] += 1
    return {
        "total_top_level_ops": sum(counts.values()),
        "ops": dict(counts.most_common()),
        "top_shapes": [{"op": op, "input_shapes": s, "count": c}
                       for (op, s), c in shapes.most_common(15)],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model")
    parser.add_argument("--batch", type=int, default=None, help="default 8; quick 2")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    harness.record_start(args.allow_loaded)
    import keras
    import numpy as np
    import torch

    import keras_vmoe

    overrides = QUICK if args.quick else TINY
    batch = args.batch or (2 if args.quick else 8)
    keras.utils.set_random_seed(0)
    model = keras_vmoe.presets.from_preset("vmoe_s32", load_weights=False,
                                           num_classes=NUM_CLASSES, **overrides)
    size = overrides["image_size"]
    x = torch.as_tensor(np.random.default_rng(0).uniform(
        -1, 1, (batch, size, size, 3)).astype("float32"))
    with torch.no_grad():
        model(x, training=False)  # build and warm up
        inference = op_counts(lambda: model(x, training=False))
    training = op_counts(lambda: model(x, training=True))
    result = {"benchmark": "torch_ops", "model": overrides, "batch": batch,
              "torch": torch.__version__, "keras": keras.__version__,
              "forward_inference": inference, "forward_training": training}
    return harness.write_result(result, args.output)


if __name__ == "__main__":
    main()
