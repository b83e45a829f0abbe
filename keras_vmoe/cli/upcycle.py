"""Sparse upcycling: turn a dense ViT into an MoE preset.

Each chosen block's MLP is copied into all its experts, the routers are
drawn fresh (seeded), the other weights are copied; metadata.json records
the source (`weights.kind == "upcycled"`).

Examples:
  keras-vmoe upcycle --from vit_b16_augreg_imagenet21k --output ./vmoe_b16_up \\
      --num-experts 8 --layout every2
  keras-vmoe upcycle --from ViT-B_16.npz --output ./up --layout last2 --renormalize-gates
  keras-vmoe upcycle --from ./my_vit_preset --output ./up --moe-type soft
"""

import json

from keras_vmoe import presets
from keras_vmoe.cli.arguments import positive_float
from keras_vmoe.cli.arguments import positive_int

MOE_TYPES = ("sparse", "soft", "ensemble")


def _layers(text):
    import argparse

    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated block indices (e.g. 1,3), got {text!r}"
        ) from None


def add_arguments(parser):
    parser.add_argument("--from", dest="source", required=True,
                        help="dense ViT: preset name or directory, or a vit_jax .npz")
    parser.add_argument("--output", required=True, help="preset directory to write")
    parser.add_argument("--num-experts", type=positive_int, default=8,
                        help="experts per MoE block (default 8)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--layout", default=None,
                       help="which blocks: every2 (default), last2, last5, last_half")
    where.add_argument("--moe-layers", type=_layers, default=None,
                       help="explicit 0-based block indices, e.g. 1,3")
    parser.add_argument("--moe-type", choices=MOE_TYPES, default="sparse",
                        help="sparse Token Choice (default), soft (Soft MoE), "
                             "ensemble (E³)")
    parser.add_argument("--num-selected-experts", type=positive_int, default=None,
                        help="K of Token Choice (default 2; E³: 1)")
    parser.add_argument("--capacity-factor", type=positive_float, default=None,
                        help="router capacity factor (default 1.05; E³: 1.5)")
    parser.add_argument("--renormalize-gates", action="store_true",
                        help="top-K gates divided by their sum: starts exactly at "
                             "the dense function when no token is dropped")
    parser.add_argument("--ensemble-size", type=positive_int, default=2,
                        help="E³ members (with --moe-type ensemble)")
    parser.add_argument("--num-classes", type=positive_int, default=None,
                        help="new zero-initialised head of this size")
    parser.add_argument("--image-size", type=positive_int, default=None,
                        help="resolution (resizes learned position embeddings)")
    parser.add_argument("--seed", type=int, default=0, help="router seed (default 0)")


def run(args):
    overrides = {k: v for k, v in (("num_classes", args.num_classes),
                                   ("image_size", args.image_size)) if v is not None}
    router = {k: v for k, v in (("num_selected_experts", args.num_selected_experts),
                                ("capacity_factor", args.capacity_factor))
              if v is not None}
    if args.moe_type == "soft" and router:
        raise ValueError("--num-selected-experts/--capacity-factor apply to sparse "
                         "and ensemble MoE layers, not --moe-type soft.")
    model = presets.upcycle(
        args.source, num_experts=args.num_experts, moe_layers=args.moe_layers,
        layout=args.layout, router=router or None, moe_type=args.moe_type,
        renormalize_gates=args.renormalize_gates, ensemble_size=args.ensemble_size,
        seed=args.seed, preset_overrides=overrides or None)
    path = presets.save_to_preset(model, args.output)
    backbone = getattr(model, "backbone", model)
    print(json.dumps({"output": path, "class_name": type(model).__name__,
                      "moe_layers": list(backbone.moe_layers),
                      "num_experts": args.num_experts, "moe_type": args.moe_type,
                      "parameters": int(model.count_params())}))
    return 0
