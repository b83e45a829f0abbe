"""keras-vmoe evaluate: evaluate a preset on a dataset and write the figures.

What applies to the model: top-1/top-5 accuracy, NLL, ECE and a reliability
diagram; E³ ensemble vs member metrics; per-layer routing statistics with
expert x class and expert x position heatmaps; accuracy vs capacity factor,
with and without BPR; with --few-shot-split, the few-shot linear probe.
Writes OUTPUT/metrics.json, reliability_diagram.png, routing_heatmaps.png
and capacity_curve.png.
"""

import argparse
import os

from keras_vmoe import presets
from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.cli import emit_json
from keras_vmoe.cli import progress
from keras_vmoe.cli.arguments import capacity_factor_list
from keras_vmoe.cli.arguments import dataset_spec
from keras_vmoe.cli.arguments import positive_int as _positive_int
from keras_vmoe.cli.finetune import DEFAULT_OUTPUT

DEFAULT_PRESET = os.path.join(DEFAULT_OUTPUT, "preset")
DEFAULT_CAPACITY_FACTORS = "0.25,0.5,1,1.5,2"


def _int_list(text):
    values = [_positive_int(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _capacity_factors(text):
    return capacity_factor_list(text, allow_none=True)


def check_preset(preset):
    """Raises a clear error unless `preset` can name a preset (no Keras import)."""
    if "://" in preset:
        return preset
    if os.path.isdir(preset):
        if not os.path.isfile(os.path.join(preset, "config.json")):
            raise FileNotFoundError(
                f"--preset {preset!r} is a folder without config.json: not a preset "
                "directory (save one with keras_vmoe.presets.save_to_preset).")
        return preset
    if resolve_preset_name(preset) is not None:
        return preset
    hint = (" Run `keras-vmoe finetune` first, or pass --preset."
            if preset == DEFAULT_PRESET else " See `keras-vmoe presets`.")
    raise FileNotFoundError(f"Unknown preset {preset!r}: not a built-in name and not a "
                            f"preset directory.{hint}")


def add_arguments(parser):
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help="preset name or directory (default: the output of "
                        f"`keras-vmoe finetune`, ./{DEFAULT_PRESET})")
    parser.add_argument("--no-weights", action="store_true",
                        help="random weights (architecture presets; for a quick check)")
    parser.add_argument("--data", type=dataset_spec, default="digits",
                        help="'digits' (embedded, default), 'tfds:NAME' or an image folder")
    parser.add_argument("--split", default="test",
                        help="evaluation split, TFDS slicing allowed (default: test)")
    parser.add_argument("--capacity-factors", type=_capacity_factors,
                        default=_capacity_factors(DEFAULT_CAPACITY_FACTORS),
                        help="inference capacity factors of the sweep, or 'none' "
                        f"(default: {DEFAULT_CAPACITY_FACTORS})")
    parser.add_argument("--few-shot-split", default=None,
                        help="split to draw few-shot examples from (e.g. train); "
                        "default: no few-shot probe")
    parser.add_argument("--shots", type=_int_list, default=[1, 5, 10, 25],
                        help="few-shot shot counts (default: 1,5,10,25)")
    parser.add_argument("--batch-size", type=_positive_int, default=64)
    parser.add_argument("--output", default=os.path.join(DEFAULT_OUTPUT, "evaluation"),
                        help="folder for metrics.json and the PNGs")
    parser.add_argument("--json", action="store_true",
                        help="print the metrics JSON on stdout")


def _summary(report):
    lines = []
    classification = report.get("classification")
    if classification:
        lines.append(
            f"top-1 {100 * classification['top1_accuracy']:.2f}%  "
            f"top-5 {100 * classification['top5_accuracy']:.2f}%  "
            f"NLL {classification['nll']:.4f}  ECE {100 * classification['ece']:.2f}%  "
            f"({classification['num_examples']} examples)")
    ensemble = report.get("ensemble")
    if ensemble:
        lines.append(f"E³ mean member top-1 {100 * ensemble['member_mean']['top1_accuracy']:.2f}%"
                     f"  disagreement {100 * ensemble['disagreement']:.1f}%")
    for name, layer in (report.get("routing") or {}).get("layers", {}).items():
        load = layer["expert_load"]
        lines.append(f"{name}: dropped tokens {100 * layer['tokens_dropped_fraction']:.2f}%  "
                     f"expert load min/max {min(load):.3f}/{max(load):.3f}")
    for row in (report.get("capacity_sweep") or {}).get("rows", []):
        accuracy = row["accuracy"]
        accuracy = "n/a" if accuracy is None else f"{100 * accuracy:.2f}%"
        lines.append(f"capacity {row['capacity_factor']:g} "
                     f"{'BPR    ' if row['batch_priority'] else 'vanilla'}: top-1 {accuracy}  "
                     f"dropped {100 * row['tokens_dropped_fraction']:.2f}%")
    for key, value in (report.get("few_shot") or {}).items():
        if key != "skipped":
            lines.append(f"{key}: {100 * value['accuracy']:.2f}% (l2={value['l2']:g})")
    for path in (report.get("files") or {}).values():
        lines.append(f"wrote {path}")
    return "\n".join(lines)


def run(args):
    check_preset(args.preset)
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise NotADirectoryError(f"--output {args.output!r} exists and is not a folder.")
    progress("loading Keras and JAX")
    from keras_vmoe import data  # lazy: a faster CLI start-up
    from keras_vmoe import evaluation  # lazy: a faster CLI start-up

    progress(f"loading {args.preset}")
    model = presets.from_preset(args.preset, load_weights=not args.no_weights)
    backbone = getattr(model, "backbone", model)
    image_size = backbone.image_size
    common = {"image_size": image_size, "batch_size": args.batch_size}
    progress(f"loading {args.data} [{args.split}]")
    test = data.load_dataset(args.data, args.split, **common)
    few_shot = (data.load_dataset(args.data, args.few_shot_split, **common)
                if args.few_shot_split else None)
    report = evaluation.evaluate(
        model, test, output_dir=args.output, batch_size=args.batch_size,
        capacity_factors=args.capacity_factors, few_shot_data=few_shot,
        shots=args.shots, progress=progress)
    report.update(preset=args.preset, data=args.data, split=args.split)
    if args.json:
        emit_json(report)
    else:
        print(_summary(report))
    return 0
