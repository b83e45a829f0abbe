"""List the built-in presets: name, aliases, family, parameters, resolution,
weights (here / downloadable / none), reported result (%) and description.

Examples:
  keras-vmoe presets --family vmoe --with-weights
  keras-vmoe presets --json | jq '.presets[] | select(.weights != "none") | .name'
  keras-vmoe presets --names            # plain names, one per line
  keras-vmoe presets VMOE_S32           # one preset's facts (names ignore case)

The table fits the terminal (or $COLUMNS).
"""

import json
import os
import sys

from keras_vmoe import catalog
from keras_vmoe.catalog import names
from keras_vmoe.cli import emit_text
from keras_vmoe.presets import table

FAMILIES = ("vit", "vmoe", "vmoe_15b", "soft_moe", "eee")


def add_arguments(parser):
    parser.add_argument("name", nargs="?", default=None,
                        help="show only this preset or alias (case-insensitive)")
    parser.add_argument("--family", default=None, choices=FAMILIES,
                        help="only the presets of this model family")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--with-weights", dest="with_weights", action="store_const",
                         const=True, default=None,
                         help="only presets with released weights")
    weights.add_argument("--without-weights", dest="with_weights", action="store_const",
                         const=False, help="only architectures without weights")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true",
                        help="JSON: every preset with its facts, and the aliases")
    output.add_argument("--names", action="store_true",
                        help="plain preset names, one per line")


def _select(args):
    rows = table.list_presets(args.family, args.with_weights, details=True)
    if args.name is None:
        return rows
    canonical = names.resolve_preset_name(args.name)
    if canonical is None:
        raise names.unknown_preset_error(args.name)
    return [row for row in rows if row["name"] == canonical] or [
        table.preset_details(canonical)
    ]


def format_details(row):
    """One preset's facts, one per line (`keras-vmoe presets NAME`)."""
    weights = {
        "here": "available here",
        "downloadable": "downloadable (fetched and converted on first use)",
        "none": "architecture only: no checkpoint was released, "
                "from_preset builds it with random weights",
    }[row["weights"]]
    classes = f"{row['num_classes']:,}"
    if row.get("dataset"):
        classes += f" ({row['dataset']} classes)"
    if row["family"] == "eee":
        task, scores = ("EnsembleImageClassifier", "the log of the members' mean "
                        "probabilities; predict_members gives each member's logits")
    else:
        task, scores = "ImageClassifier", "logits"
    facts = [
        ("family", f"{row['family']} ({row['variant']})"),
        ("aliases", ", ".join(row["aliases"]) or "-"),
        ("parameters", f"{row['parameters']:,} ({table.format_count(row['parameters'])})"),
        ("image size", f"{row['image_size']} px"),
        ("outputs", f"{classes}: {task}.predict returns (images, "
                    f"{row['num_classes']:,}) class scores ({scores})"),
        ("weights", weights),
        ("reported", row["accuracy_summary"] or "-"),
        ("paper", row.get("paper") or "-"),
        ("description", row["description"]),
    ]
    return "\n".join([row["name"], *(f"  {k:12s} {v}" for k, v in facts)])


def run(args):
    rows = _select(args)
    if args.json:
        chosen = {row["name"] for row in rows}
        text = json.dumps({
            "presets": rows,
            "aliases": {a: t for a, t in sorted(catalog.ALIASES.items()) if t in chosen},
        }, indent=2, ensure_ascii=False)
    elif args.names:
        text = "\n".join(row["name"] for row in rows)
    elif args.name is not None:
        text = "\n\n".join(format_details(row) for row in rows)
    else:
        text = table.format_table(rows, width=table.terminal_width(sys.stdout))
    try:
        emit_text(text)
    except BrokenPipeError:  # e.g. `keras-vmoe presets | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
