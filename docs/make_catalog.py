"""Writes docs/catalog.md, the table of every built-in preset, from the
catalog (`keras_vmoe.presets.list_presets(details=True)`).

    python docs/make_catalog.py          # rewrites docs/catalog.md
    python docs/make_catalog.py --check  # exit 1 when docs/catalog.md is stale

The docs tests run the check, so the page follows the catalog.
"""

import pathlib
import sys

PAGE = pathlib.Path(__file__).with_name("catalog.md")

HEADER = """# Preset catalog

Every built-in preset, generated from the catalog by `python
docs/make_catalog.py` (`keras-vmoe presets` prints the same rows). Weights
`downloadable`: the released checkpoint is converted on the first
`from_preset` (see [Presets and conversion](guides/presets.md)); `none`: the
architecture only (`load_weights=False`). Accuracies are the papers' and
upstream's, not measured here.

| preset | family | variant | parameters | image size | classes | weights | reported accuracy |
|---|---|---|---:|---:|---:|---|---|
"""


def _parameters(count):
    if count >= 1e9:
        return f"{count / 1e9:.2f} B"
    return f"{count / 1e6:.1f} M"


def render():
    """The page's text. Where weights are depends on this machine (a cache, a
    mirror); the page describes a fresh install, so both are left out."""
    import os
    import tempfile

    os.environ.pop("KERAS_VMOE_CHECKPOINT_ROOT", None)
    os.environ["KERAS_HOME"] = tempfile.mkdtemp()
    from keras_vmoe.presets import list_presets

    rows = []
    for row in list_presets(details=True):
        rows.append(
            f"| `{row['name']}` | {row['family']} | {row['variant']} | "
            f"{_parameters(row['parameters'])} | {row['image_size']} | "
            f"{row['num_classes']} | {row['weights']} | {row['accuracy_summary']} |")
    return HEADER + "\n".join(rows) + "\n"


def main(argv):
    text = render()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is stale: run `python docs/make_catalog.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
