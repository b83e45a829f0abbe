"""Catalog of built-in presets: name -> architecture, routing, weights, metadata.

The catalog is data: one JSON file per model family beside this module
(`vit.json`, `vmoe.json`, `vmoe_15b.json`, `soft_moe.json`, `eee.json`),
each `{"family": ..., "presets": {name: entry}, "aliases": {alias: name}}`.
This module merges them into `PRESETS` and `ALIASES`. Every entry has:

* `description`: one line for `list_presets()` and model cards.
* `family`, `variant`, `overrides`: the arguments of
  `keras_vmoe.models.configs.backbone_config(family, variant, **overrides)`
  that give the backbone constructor arguments (the image size is added
  from `image_size`).
* `image_size`: the input resolution the weights (or the paper) use.
* `task`: `{"class": "ImageClassifier" | "EnsembleImageClassifier",
  "num_classes", "head_bias_init"}`, the task (its registered keras_vmoe
  class) put on the backbone.
* `routing`: the training routing of the MoE layers (the
  `backbone.set_routing` arguments, used by `fit`): `num_selected_experts`
  (K), `capacity_factor` (the value upstream trains or fine-tunes with),
  `images_per_group` and `batch_priority` (BPR). Empty for dense and Soft
  MoE models. `images_per_group` is upstream's grouping,
  `metadata["upstream_group_size"]` / (tokens per image x ensemble size):
  8 images (128 for the E³ CIFAR-100 fine-tune, upstream's per-device
  batch). A batch that is not a multiple is padded with masked tokens, so
  an image's prediction depends only on the images of its own group.
* `eval_routing` (optional): the settings that differ in evaluation
  (`evaluate`/`predict`), e.g. `{"capacity_factor": 4.0}` for light1 and
  8.0 for the E³ ImageNet models (upstream's `model_eval_overrides`).
* `weights`: `None` for architectures without released weights, else
  `{"format": "vmoe_partitioned" | "vit_npz", "upstream": "gs://..."}`.
  `vmoe_partitioned` is the checkpoint prefix (files `<prefix>.index` and
  `<prefix>.data-*`) of google-research/vmoe; `vit_npz` a `.npz` file of
  google-research/vision_transformer.
* `metadata`: `paper` (arXiv id), `params` (exact parameter count of the
  preset's model), `paper_params` (as printed in the paper, when the
  preset reproduces a paper model), `dataset`, `accuracy` (as reported,
  in %), `source` (where the facts come from) and `notes`.

`ALIASES` maps short names (e.g. `vmoe_b32`) to catalog names.

An alias lives in the file of its target's family. Add a preset by adding an
entry to its family's file; `tests/presets/test_catalog.py` checks the
schema and that `params` equals `count_parameters` of the built model.

Facts come from the papers (V-MoE arXiv:2106.05974 Table 8; Soft MoE
arXiv:2308.00951 Table 1 and its configs; E³ arXiv:2110.03360 Tables 20,
23, 25) and from the google-research/vmoe and vision_transformer READMEs
and configs. Values marked "assumed" in `notes` are not stated upstream.
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
                    f"family {entry.get('family')!r}."
                )
            presets[name] = entry
        for alias, target in data.get("aliases", {}).items():
            if alias in aliases:
                raise ValueError(f"Alias {alias!r} in {family}.json is a duplicate.")
            aliases[alias] = target
    return presets, aliases


PRESETS, ALIASES = _load()

__all__ = ["ALIASES", "FAMILY_FILES", "PRESETS"]
