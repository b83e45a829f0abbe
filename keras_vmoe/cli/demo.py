"""keras-vmoe demo: route real photos through a V-MoE and report routing.

Routes scikit-image's photos through a small V-MoE (random weights) or
--preset at several capacity factors, vanilla and with Batch Prioritized
Routing, and prints per-layer routing statistics as JSON on stdout.
"""

import sys

from keras_vmoe import presets
from keras_vmoe.catalog import names
from keras_vmoe.cli import emit_json
from keras_vmoe.cli import progress
from keras_vmoe.cli.arguments import capacity_factor_list
from keras_vmoe.utils import keras_internals
from keras_vmoe.utils.extras import require

DEFAULT_IMAGES = ("chelsea", "astronaut", "coffee", "rocket", "colorwheel",
                  "hubble_deep_field", "immunohistochemistry", "retina")

# A small V-MoE that runs in seconds on a CPU: the demo's default model.
DEMO_BACKBONE = {
    "image_size": 128,
    "patch_size": 16,
    "hidden_dim": 128,
    "num_layers": 4,
    "num_heads": 4,
    "mlp_dim": 256,
    "classifier": "token",
    "moe_layers": (1, 3),
    "moe": {
        "num_experts": 8,
        "identical_init": False,
        "router": {"name": "token_choice", "num_selected_experts": 2,
                   "capacity_factor": 1.05},
    },
}


def load_skimage_photos(names, image_size):
    """scikit-image's photos as `(B, H, W, 3)` in [-1, 1], short side resized
    to `image_size` and centrally cropped (upstream's evaluation preprocessing)."""
    import numpy as np

    skdata = require("skimage.data", "`keras-vmoe demo` (its sample photos)")
    transform = require("skimage.transform", "`keras-vmoe demo`")

    images = []
    for name in names:
        loader = getattr(skdata, name, None)
        if loader is None:
            raise ValueError(
                f"Unknown scikit-image photo {name!r}. Choose from: "
                f"{', '.join(DEFAULT_IMAGES)} (any RGB image of skimage.data)."
            )
        image = np.asarray(loader())
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        image = image[..., :3].astype("float32") / 255.0
        h, w = image.shape[:2]
        scale = image_size / min(h, w)
        new_hw = (max(image_size, round(h * scale)), max(image_size, round(w * scale)))
        image = transform.resize(image, new_hw, order=1, anti_aliasing=True)
        top = (new_hw[0] - image_size) // 2
        left = (new_hw[1] - image_size) // 2
        image = image[top:top + image_size, left:left + image_size]
        images.append(image * 2.0 - 1.0)
    return np.stack(images).astype("float32")


def _demo_model(args):
    from keras_vmoe import models  # lazy: no Keras at CLI start-up

    if args.preset:
        model = presets.from_preset(args.preset, load_weights=not args.no_weights)
        return getattr(model, "backbone", model)
    keras_internals.set_random_seed(args.seed)
    return models.VisionTransformerBackbone(**DEMO_BACKBONE, name="vmoe_demo")


def _weights_note(args):
    """What the demo's weights are: `(key, sentence)`."""
    if not args.preset:
        return "random", ("the demo model has random weights (seed "
                          f"{args.seed}): it shows routing, it classifies nothing")
    if args.no_weights:
        return "random", f"{args.preset} with random weights (--no-weights)"
    canonical = names.resolve_preset_name(args.preset)
    if canonical is None:  # a directory or handle: its own weights
        return "pretrained", f"{args.preset} with the weights it holds"
    if names.weights_location(canonical) == "none":
        return "random", (f"{args.preset} is architecture only (no released "
                          "weights): random weights")
    return "pretrained", f"{args.preset} with its pretrained weights"


def run(args):
    """Routes real photos through a V-MoE and prints routing statistics as JSON."""
    weights, note = _weights_note(args)
    progress(f"building {args.preset or 'the demo V-MoE'}: {note}")
    backbone = _demo_model(args)
    names = args.images.split(",") if args.images else list(DEFAULT_IMAGES)
    image_size = backbone.image_size
    if isinstance(image_size, (list, tuple)):
        image_size = image_size[0]
    if not backbone.moe_layers:
        print(
            f"keras-vmoe demo: {args.preset!r} is a dense ViT (no MoE layers): "
            "there is no routing to report. Choose a V-MoE, Soft MoE or E³ preset "
            "(keras-vmoe presets).",
            file=sys.stderr,
        )
        return 2
    images = load_skimage_photos(names, image_size)
    tokens = backbone.num_tokens
    report = {
        "model": backbone.name,
        "weights": weights,
        "parameters": int(backbone.count_params()),
        "images": names,
        "image_size": image_size,
        "tokens_per_image": tokens,
        "moe_layers": list(backbone.moe_layers),
        "runs": [],
    }
    if backbone.moe_type == "soft":
        # Soft MoE has no capacity to trade: nothing is dropped.
        progress(f"routing {len(names)} photos (compiles once, then runs)")
        report["runs"].append({"layers": backbone.routing_metrics(images)})
    else:
        # The whole batch (with E³'s copies) is one group competing for capacity.
        backbone.set_routing(group_size=len(names) * tokens * backbone.ensemble_size)
        router = backbone.get_moe_layers()[0].router
        priorities = (False, True) if hasattr(router, "batch_priority") else (None,)
        total = len(args.capacity_factors) * len(priorities)
        for capacity_factor in args.capacity_factors:
            for bpr in priorities:
                step = len(report["runs"]) + 1
                progress(f"[{step}/{total}] routing {len(names)} photos at capacity "
                         f"factor {capacity_factor:g}"
                         + ("" if bpr is None else f", BPR {'on' if bpr else 'off'}")
                         + (" (each setting compiles once)" if step == 1 else ""))
                backbone.set_routing(capacity_factor=capacity_factor,
                                     batch_priority=bpr)
                metrics = backbone.routing_metrics(images)
                setting = {"capacity_factor": capacity_factor}
                if bpr is not None:
                    setting["batch_priority"] = bpr
                report["runs"].append({**setting, "layers": metrics})
    emit_json(report)
    return 0


def add_arguments(parser):
    parser.add_argument("--images", default=None,
                        help="comma-separated skimage.data photo names")
    parser.add_argument("--preset", default=None, help="use a preset instead of the demo model")
    parser.add_argument("--no-weights", action="store_true",
                        help="with --preset: random weights, do not fetch")
    parser.add_argument("--capacity-factors", type=capacity_factor_list, default=[1.05, 0.5, 0.2],
                        help="capacity factors to compare, vanilla vs BPR")
    parser.add_argument("--seed", type=int, default=0)
