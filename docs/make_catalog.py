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


# Popular ViTs of other libraries that `from_preset` loads (and `upcycle`
# turns into MoE models): their handles, not catalog entries.
HUB_VITS = """
## ViTs of timm, transformers and KerasHub

`from_preset` also takes the ViTs other libraries publish, and `upcycle`
turns them into V-MoE or Soft MoE models ([Upcycle your timm
ViT](guides/upcycling-lora.md#upcycle-your-timm-vit)). A few popular ones:

| library | handle | model | image size | classes |
|---|---|---|---:|---:|
| timm | `hf://timm/vit_tiny_patch16_224.augreg_in21k` | ViT-Ti/16, AugReg | 224 | 21843 |
| timm | `hf://timm/vit_small_patch16_224.augreg_in21k_ft_in1k` | ViT-S/16, AugReg | 224 | 1000 |
| timm | `hf://timm/vit_base_patch16_224.augreg2_in21k_ft_in1k` | ViT-B/16, AugReg | 224 | 1000 |
| timm | `hf://timm/vit_base_patch16_384.augreg_in21k_ft_in1k` | ViT-B/16, AugReg | 384 | 1000 |
| timm | `hf://timm/deit_small_patch16_224.fb_in1k` | DeiT-S/16 | 224 | 1000 |
| timm | `hf://timm/deit_base_patch16_224.fb_in1k` | DeiT-B/16 | 224 | 1000 |
| transformers | `hf://google/vit-base-patch16-224` | ViT-B/16 | 224 | 1000 |
| transformers | `hf://google/vit-base-patch16-224-in21k` | ViT-B/16 (no head) | 224 | - |
| transformers | `hf://google/vit-large-patch16-224` | ViT-L/16 | 224 | 1000 |
| KerasHub | `kaggle://keras/vit/keras/vit_base_patch16_224_imagenet` | ViT-B/16 | 224 | 1000 |

Refused before any download, naming the feature: layer scale (DeiT III,
DINOv2), registers, CLIP's pre-norm, qk-norm, rotary embeddings,
attention pooling, a distillation token, a LayerNorm after average pooling
(`fc_norm`), and architectures other than ViT.
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
    return HEADER + "\n".join(rows) + "\n" + HUB_VITS


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
