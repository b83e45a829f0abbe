"""The preset catalog as a table: `list_presets()` and `keras-vmoe presets`.

Everything here is read from the catalog data (no Keras import), so listing
is instant. Parameter counts are the catalog's `metadata.params`, which
`tests/presets/test_catalog.py` checks against `count_parameters` of the
built models.
"""

import shutil

from keras_vmoe.presets.catalog import ALIASES
from keras_vmoe.presets.catalog import FAMILY_FILES
from keras_vmoe.presets.catalog import PRESETS
from keras_vmoe.presets.names import weights_location

# How `weights_location` reads in the table.
WEIGHTS_LABELS = {
    "here": "available here",
    "downloadable": "downloadable",
    "none": "architecture only",
}
# The accuracy a table cell shows: the first of these the preset reports.
# Keys of the catalog's `metadata.accuracy` (in %) and how a cell names them;
# `test`/`val` are on the preset's own dataset.
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


def _aliases_of(name):
    return sorted(alias for alias, target in ALIASES.items() if target == name)


def _accuracy_summary(accuracy, dataset):
    if not accuracy:
        return ""
    key = next((k for k in _ACCURACY_LABELS if k in accuracy), sorted(accuracy)[0])
    label = _ACCURACY_LABELS.get(key, key).format(dataset=dataset)
    return f"{accuracy[key]:g} ({label})"


def preset_details(name):
    """The facts of one built-in preset as a flat dict (one table row).

    Keys: `name`, `aliases`, `family`, `variant`, `parameters` (exact
    count), `image_size`, `num_classes`, `weights` (`"here"`,
    `"downloadable"` or `"none"`, see `names.weights_location`),
    `weights_source` (upstream URL or `None`), `accuracy` (as reported, in
    %, or `None`), `accuracy_summary` (one cell), `dataset`, `paper` and
    `description`.
    """
    entry = PRESETS[name]
    metadata = entry["metadata"]
    return {
        "name": name,
        "aliases": _aliases_of(name),
        "family": entry["family"],
        "variant": entry["variant"],
        "parameters": metadata["params"],
        "image_size": entry["image_size"],
        "num_classes": entry["task"]["num_classes"],
        "weights": weights_location(name),
        "weights_source": (entry["weights"] or {}).get("upstream"),
        "accuracy": metadata.get("accuracy"),
        "accuracy_summary": _accuracy_summary(
            metadata.get("accuracy"), metadata.get("dataset")
        ),
        "dataset": metadata.get("dataset"),
        "paper": metadata.get("paper"),
        "description": entry["description"],
    }


def list_presets(family=None, with_weights=None, details=False):
    """The built-in presets, sorted by name.

    Args:
        family: optional family filter: `"vit"`, `"vmoe"`, `"vmoe_15b"`,
            `"soft_moe"` or `"eee"`.
        with_weights: `True`: only presets with released weights (here or
            downloadable); `False`: only architectures without weights;
            `None` (default): all.
        details: `False` (default) returns the names (aliases not
            included); `True` returns one dict of facts per preset (see
            `preset_details`), ready for a table.

    Returns:
        A list of names, or of dicts when `details=True`.

    Examples:

    >>> "vmoe_s32_last2_ilsvrc2012_randaug_light1" in list_presets("vmoe")
    True
    >>> row = list_presets("eee", with_weights=True, details=True)[-1]
    >>> row["name"], row["parameters"], row["accuracy_summary"]
    ('eee_s32_last2_ilsvrc2012_ft_cifar100', 56520804, '81.26 (CIFAR-100 test)')
    """
    if family is not None and family not in FAMILY_FILES:
        raise ValueError(
            f"Unknown preset family {family!r}. Valid families: {sorted(FAMILY_FILES)}."
        )
    if with_weights not in (None, True, False):
        raise ValueError(
            f"`with_weights` must be None, True or False. Received: {with_weights!r}"
        )
    names = sorted(
        name
        for name, entry in PRESETS.items()
        if (family is None or entry["family"] == family)
        and (with_weights is None or (entry["weights"] is not None) == with_weights)
    )
    if not details:
        return names
    return [preset_details(name) for name in names]


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


def format_table(rows, width=None):
    """Rows of `list_presets(details=True)` as an aligned text table.

    Args:
        rows: a list of `preset_details` dicts.
        width: optional line width: the description column is cut to fit
            (with `…`). `None` keeps full descriptions.

    Returns:
        The table as one string (header, rule, one line per preset).
    """
    headers = [title for title, _ in COLUMNS]
    cells = [[_cell(row, key) for _, key in COLUMNS] for row in rows]
    widths = [
        max([len(headers[i]), *(len(line[i]) for line in cells)])
        for i in range(len(COLUMNS))
    ]
    widths[-1] = len(headers[-1])

    def line(values):
        padded = [v.ljust(w) for v, w in zip(values[:-1], widths[:-1], strict=True)]
        text = "  ".join([*padded, values[-1]])
        if width is not None and len(text) > width:
            text = text[: max(width - 1, sum(widths[:-1]))] + "…"
        return text.rstrip()

    rule = ["-" * w for w in widths[:-1]] + ["-" * len(headers[-1])]
    return "\n".join([line(headers), line(rule), *(line(c) for c in cells)])


def terminal_width(stream):
    """The terminal's width when `stream` is a terminal, else `None`."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return None
    return shutil.get_terminal_size().columns
