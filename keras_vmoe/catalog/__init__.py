"""Catalog of built-in presets: name -> architecture, routing, weights, metadata.

The data is one JSON file per model family beside this module (`vit.json`,
`vmoe.json`, ...), each `{"family", "presets": {name: entry}, "aliases"}`;
they are merged into `PRESETS` and `ALIASES`. `tests/presets/test_catalog.py`
checks the schema and the parameter counts.
"""

import json
from importlib import resources

# One data file per family, in the order `list_presets(details=True)` groups them.
FAMILY_FILES = ("vit", "vmoe", "vmoe_15b", "soft_moe", "eee")


def _load():
    presets, aliases = {}, {}
    folder = resources.files(__name__)
    for family in FAMILY_FILES:
        data = json.loads((folder / f"{family}.json").read_text(encoding="utf-8"))
        if data.get("family") != family:
            raise ValueError(f"{family}.json declares family {data.get('family')!r}.")
        for name, entry in data["presets"].items():
            if name in presets or entry.get("family") != family:
                raise ValueError(
                    f"Preset {name!r} in {family}.json is a duplicate or has "
                    f"family {entry.get('family')!r}.")
            presets[name] = entry
        for alias, target in data.get("aliases", {}).items():
            if alias in aliases:
                raise ValueError(f"Alias {alias!r} in {family}.json is a duplicate.")
            aliases[alias] = target
    return presets, aliases


PRESETS, ALIASES = _load()

__all__ = ["ALIASES", "FAMILY_FILES", "PRESETS"]
