"""The preset catalog as a table: `list_presets()` and `keras-vmoe presets`.

Read from the catalog data alone (no Keras import), so listing is instant.
"""

import os
import shutil

from keras_vmoe.catalog import ALIASES
from keras_vmoe.catalog import FAMILY_FILES
from keras_vmoe.catalog import PRESETS
from keras_vmoe.catalog.names import weights_location
from keras_vmoe.utils.validation import check_one_of

# How `weights_location` reads in the table.
WEIGHTS_LABELS = {
    "here": "available here",
    "downloadable": "downloadable",
    "none": "architecture only",
}
# Keys of the catalog's `metadata.accuracy` and their labels: a cell shows the
# first one the preset reports.
_ACCURACY_LABELS = {
    "test": "{dataset} test",
    "in_top1": "ImageNet top-1",
    "in_finetune": "ImageNet fine-tuned",
    "val": "{dataset} val",
    "lit_in_0shot": "ImageNet 0-shot, LiT",
    "in_10shot": "ImageNet 10-shot",
    "jft_p1": "JFT prec@1",
    "in_error": "ImageNet error",
}
COLUMNS = (
    ("name", "name"),
    ("aliases", "aliases"),
    ("family", "family"),
    ("params", "parameters"),
    ("res", "image_size"),
    ("weights", "weights"),
    ("reported %", "accuracy_summary"),
    ("description", "description"),
)


def _accuracy_summary(accuracy, dataset):
    if not accuracy:
        return ""
    key = next((k for k in _ACCURACY_LABELS if k in accuracy), sorted(accuracy)[0])
    label = _ACCURACY_LABELS.get(key, key).format(dataset=dataset)
    return f"{accuracy[key]:g} ({label})"


def preset_details(name):
    """The facts of one built-in preset as a flat dict (one table row)."""
    entry = PRESETS[name]
    metadata = entry["metadata"]
    return {
        "name": name,
        "aliases": sorted(a for a, target in ALIASES.items() if target == name),
        "family": entry["family"],
        "variant": entry["variant"],
        "parameters": metadata["params"],
        "image_size": entry["image_size"],
        "num_classes": entry["task"]["num_classes"],
        "weights": weights_location(name),
        "weights_source": (entry["weights"] or {}).get("upstream"),
        "accuracy": metadata.get("accuracy"),
        "accuracy_summary": _accuracy_summary(metadata.get("accuracy"),
                                              metadata.get("dataset")),
        "dataset": metadata.get("dataset"),
        "paper": metadata.get("paper"),
        "description": entry["description"],
    }


def list_presets(family=None, with_weights=None, details=False):
    """The built-in presets, sorted by name.

    Args:
        family: optional family filter: `"vit"`, `"vmoe"`, `"vmoe_15b"`,
            `"soft_moe"` or `"eee"`.
        with_weights: `True`: only presets with released weights; `False`:
            only architectures without; `None`: all.
        details: `True` returns one dict of facts per preset
            (`preset_details`) instead of the names (aliases not included).

    Returns:
        A list of names, or of dicts when `details=True`.

    Examples:

    >>> "vmoe_s32_last2_ilsvrc2012_randaug_light1" in list_presets("vmoe")
    True
    >>> row = list_presets("eee", with_weights=True, details=True)[-1]
    >>> row["name"], row["parameters"], row["accuracy_summary"]
    ('eee_s32_last2_ilsvrc2012_ft_cifar100', 56520804, '81.26 (CIFAR-100 test)')
    """
    if family is not None:
        check_one_of(family, "family", FAMILY_FILES)
    check_one_of(with_weights, "with_weights", (None, True, False))
    names = sorted(
        name
        for name, entry in PRESETS.items()
        if (family is None or entry["family"] == family)
        and (with_weights is None or (entry["weights"] is not None) == with_weights)
    )
    return [preset_details(name) for name in names] if details else names


def format_count(count):
    """`56999400` -> `"57.0M"`, `14_700_000_000` -> `"14.7B"`."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def _cell(row, key):
    value = row[key]
    if key == "aliases":
        return ", ".join(value)
    if key == "parameters":
        return format_count(value)
    if key == "weights":
        return WEIGHTS_LABELS[value]
    return "" if value is None else str(value)


# Columns left out, in this order, when a table is wider than `width`.
_OPTIONAL_COLUMNS = ("aliases", "description", "family", "accuracy_summary")
# The narrowest a description is cut to before the column is left out.
_MIN_DESCRIPTION = 24


def _table_lines(rows, columns, description_width=None):
    headers = [title for title, _ in columns]
    cells = [[_cell(row, key) for _, key in columns] for row in rows]
    widths = [max(map(len, column)) for column in zip(headers, *cells, strict=True)]
    last_is_description = columns[-1][1] == "description"

    def line(values):
        values = list(values)
        if last_is_description and description_width is not None:
            text = values[-1]
            if len(text) > description_width:
                values[-1] = text[: max(description_width - 1, 0)] + "…"
        padded = [v.ljust(w) for v, w in zip(values[:-1], widths[:-1], strict=True)]
        return "  ".join([*padded, values[-1]]).rstrip()

    last = len(headers[-1]) if last_is_description else widths[-1]
    rule = ["-" * w for w in widths[:-1]] + ["-" * last]
    return [line(headers), line(rule), *(line(c) for c in cells)]


def _stacked_lines(rows, width):
    """One block per preset: the full name, then its facts, indented."""
    lines = []
    for row in rows:
        facts = [row["family"], f"{_cell(row, 'parameters')} parameters",
                 f"{row['image_size']} px", f"{row['num_classes']:,} classes",
                 _cell(row, "weights")]
        if row["accuracy_summary"]:
            facts.append(row["accuracy_summary"])
        lines.append(row["name"])
        fact_line = "    " + " · ".join(facts)
        if len(fact_line) > width:
            fact_line = fact_line[: width - 1] + "…"
        lines.append(fact_line)
    return lines


def format_table(rows, width=None):
    """Rows of `list_presets(details=True)` as an aligned text table.

    Args:
        rows: a list of `preset_details` dicts.
        width: optional line width to fit: the description is cut (with
            `…`), then the aliases, description, family and reported-result
            columns are left out, then each preset takes two lines (its name,
            then its facts). `None` keeps every column in full.

    Returns:
        The table as one string.
    """
    columns = list(COLUMNS)
    optional = list(_OPTIONAL_COLUMNS)
    while True:
        lines = _table_lines(rows, columns)
        if width is None or max(map(len, lines)) <= width:
            return "\n".join(lines)
        if columns[-1][1] == "description":
            fixed = max(map(len, _table_lines(rows, columns[:-1])))
            room = width - fixed - 2
            if room >= _MIN_DESCRIPTION:
                return "\n".join(_table_lines(rows, columns, description_width=room))
        if not optional:
            return "\n".join(_stacked_lines(rows, width))
        drop = optional.pop(0)
        columns = [c for c in columns if c[1] != drop]


def terminal_width(stream):
    """`$COLUMNS`, else the terminal's width if `stream` is one, else `None`."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return None
    return shutil.get_terminal_size().columns
