"""Model sizes and paper configurations of ViT, V-MoE, Soft MoE and E³.

`backbone_config(family, variant, **overrides)` returns the keyword arguments
of `VisionTransformerBackbone` for a paper model; `count_parameters` counts a
config's parameters from abstract (never allocated) weights. The V-MoE "S" is
*not* ViT-S: D=512 and 8 blocks (V-MoE paper, App. B.2).
"""

import contextlib
import copy
import inspect
import math
import re

import keras

from keras_vmoe.models.ensemble_classifier import EnsembleImageClassifier
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone
from keras_vmoe.utils.keras_internals import keep_uninitialized_variables
from keras_vmoe.utils.validation import check_one_of

VIT_SIZES = {
    "Ti": dict(hidden_dim=192, num_layers=12, mlp_dim=768, num_heads=3),
    "S": dict(hidden_dim=384, num_layers=12, mlp_dim=1536, num_heads=6),
    "B": dict(hidden_dim=768, num_layers=12, mlp_dim=3072, num_heads=12),
    "L": dict(hidden_dim=1024, num_layers=24, mlp_dim=4096, num_heads=16),
    "H": dict(hidden_dim=1280, num_layers=32, mlp_dim=5120, num_heads=16),
}
VMOE_SIZES = {
    "S": dict(hidden_dim=512, num_layers=8, mlp_dim=2048, num_heads=8),
    "B": dict(hidden_dim=768, num_layers=12, mlp_dim=3072, num_heads=12),
    "L": dict(hidden_dim=1024, num_layers=24, mlp_dim=4096, num_heads=16),
    "H": dict(hidden_dim=1280, num_layers=32, mlp_dim=5120, num_heads=16),
}
VMOE_15B_SIZE = dict(
    hidden_dim=1408, num_layers=48, mlp_dim=6400, num_heads=16, patch_size=14
)
# Soft MoE paper (Table 1): experts per (size, patch); otherwise 128.
SOFT_MOE_EXPERTS = {
    ("S", 16): 128,
    ("S", 14): 256,
    ("B", 16): 128,
    ("L", 16): 128,
    ("H", 14): 256,
}
FAMILIES = ("vit", "vmoe", "vmoe_15b", "soft_moe", "eee")
JFT300M_CLASSES = 18_291
JFT4B_CLASSES = 29_593
# Images per routing group in upstream's configs (the per-device batch).
UPSTREAM_IMAGES_PER_GROUP = {"vmoe": 8, "vmoe_15b": 8, "eee": 128}


def moe_layers_every(n, num_layers):
    """ "Every-n" layout: blocks `n-1, 2n-1, ...` (0-based)."""
    if n < 1:
        raise ValueError(f"`n` must be >= 1. Received: n={n}")
    return tuple(range(n - 1, num_layers, n))


def moe_layers_last(n, num_layers):
    """ "Last-n" layout: the last `n` of the odd blocks `1, 3, 5, ...`."""
    odd = tuple(range(1, num_layers, 2))
    if not 0 <= n <= len(odd):
        raise ValueError(
            f"`last{n}` needs n in [0, {len(odd)}] for num_layers={num_layers}. "
            f"Received: n={n}"
        )
    return odd[len(odd) - n :] if n else ()


def moe_layers_from_layout(layout, num_layers):
    """Decodes `"every2"`, `"last5"`, `"last_half"` or `"none"`."""
    if layout in (None, "none", "dense"):
        return ()
    if layout == "last_half":
        return tuple(range(num_layers - num_layers // 2, num_layers))
    match = re.fullmatch(r"(every|last)_?(\d+)", str(layout).lower())
    if not match:
        raise ValueError(
            "`layout` must be 'everyN', 'lastN', 'last_half' or 'none' (e.g. "
            f"'every2', 'last2', 'last5'). Received: layout={layout!r}"
        )
    kind, n = match.group(1), int(match.group(2))
    if kind == "every":
        return moe_layers_every(n, num_layers)
    return moe_layers_last(n, num_layers)


def parse_variant(variant):
    """`"B/16"` -> `("B", 16)`."""
    match = re.fullmatch(r"\s*([A-Za-z]+)\s*/\s*(\d+)\s*", str(variant))
    if not match:
        raise ValueError(
            f"`variant` must look like 'B/16' (size/patch). Received: variant={variant!r}"
        )
    return match.group(1), int(match.group(2))


def constructor_arguments():
    """The names `VisionTransformerBackbone(...)` takes, without `**kwargs`."""
    parameters = inspect.signature(VisionTransformerBackbone.__init__).parameters
    return {name for name, p in parameters.items()
            if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def _backbone_arguments():
    return constructor_arguments() | {"name", "trainable"}


def _merge(base, update):
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# The routing settings a built model changes without touching the weights.
ROUTING_OVERRIDES = ("num_selected_experts", "capacity_factor", "batch_priority",
                     "group_size", "images_per_group", "eval_routing")
# Overrides of `backbone_config` that are not backbone arguments.
MOE_OVERRIDES = ("layout", "num_experts", *ROUTING_OVERRIDES, "num_slots",
                 "bfloat16_dispatch", "router")


def _paper_size(family, variant):
    """`(size name, patch, backbone arguments)` of a family's `variant`."""
    if family == "vmoe_15b":
        if variant not in (None, "15B", "15b"):
            raise ValueError(
                f"Family 'vmoe_15b' has a single size; pass variant=None. Received: {variant!r}"
            )
        size, patch = "15B", VMOE_15B_SIZE["patch_size"]
        config = dict(VMOE_15B_SIZE)
    else:
        if variant is None:
            raise ValueError(f"Family {family!r} needs a variant such as 'B/16'.")
        size, patch = parse_variant(variant)
        table = VMOE_SIZES if family in ("vmoe", "eee") else VIT_SIZES
        if size not in table:
            raise ValueError(
                f"Unknown size {size!r} for family {family!r}. Valid sizes: {list(table)}."
            )
        config = dict(table[size], patch_size=patch)
    return size, patch, config


def _family_defaults(family, size, patch, config):
    """Sets a family's paper settings in `config`; returns `(moe, layout)`."""
    moe = None
    layout = "none"
    if family == "vit":
        config.update(classifier="token", position_embedding="learned")
    elif family in ("vmoe", "vmoe_15b", "eee"):
        eee = family == "eee"
        config.update(
            classifier="map" if family == "vmoe_15b" else "token",
            position_embedding="learned",
            # Pre-logits of size D (the V-MoE paper's counts include it).
            representation_size=None if family == "vmoe_15b" else "hidden_dim",
        )
        moe = {
            "type": "sparse",
            "num_experts": 32,
            "router": {
                "name": "token_choice",
                "num_selected_experts": 1 if eee else 2,
                "capacity_factor": 1.5 if eee else 1.05,
                "noise_std": 1.0,
                "importance_loss_weight": 0.005,
                "load_loss_weight": 0.005,
                "batch_priority": False,
            },
            "images_per_group": UPSTREAM_IMAGES_PER_GROUP[family],
            "bfloat16_dispatch": True,
        }
        if eee:
            config["ensemble_size"] = 2
            layout = "last5" if size == "H" else "last2"
        else:
            layout = "every2"
    else:  # soft_moe
        config.update(classifier="gap", position_embedding="learned", qk_norm=True)
        moe = {
            "type": "soft",
            "num_experts": SOFT_MOE_EXPERTS.get((size, patch), 128),
            "num_slots": 1,
            "bfloat16_dispatch": True,
        }
        layout = "last_half"
    return moe, layout


_GROUPINGS = (("group_size", "images_per_group"), ("images_per_group", "group_size"))


def _override_moe(moe, moe_update, moe_overrides):
    """`moe` with the `moe_update` dict merged and the `MOE_OVERRIDES` given."""
    if moe is None:
        return copy.deepcopy(moe_update) if moe_update else None
    if moe_update:
        moe = _merge(moe, moe_update)
        for key, other in _GROUPINGS:
            if key in moe_update and other not in moe_update:
                moe.pop(other, None)  # one grouping replaces the other
    for key in ("num_experts", "num_slots", "bfloat16_dispatch", "eval_routing"):
        if key in moe_overrides:
            moe[key] = moe_overrides[key]
    if (moe_overrides.get("group_size") is not None
            and moe_overrides.get("images_per_group") is not None):
        raise ValueError(
            "Set at most one of `group_size` (tokens) and `images_per_group`. "
            f"Received: group_size={moe_overrides['group_size']!r}, "
            f"images_per_group={moe_overrides['images_per_group']!r}"
        )
    for key, other in _GROUPINGS:
        if moe_overrides.get(key) is not None or (
            key in moe_overrides and other not in moe_overrides
        ):
            moe[key] = moe_overrides[key]
            moe.pop(other, None)
    if "router" in moe_overrides:
        router = moe_overrides["router"]
        base = moe.get("router", {})
        if router.get("name", base.get("name")) != base.get("name"):
            # Another router kind: keep only the generic Router settings.
            base = {k: base[k] for k in ("noise_std", "capacity_factor") if k in base}
        moe["router"] = _merge(base, router)
    for key in ("num_selected_experts", "capacity_factor", "batch_priority"):
        if key in moe_overrides:
            moe.setdefault("router", {})[key] = moe_overrides[key]
    if moe["type"] == "soft":
        for key in ("router", "group_size", "images_per_group", "eval_routing"):
            moe.pop(key, None)
    return moe


def backbone_config(family, variant=None, **overrides):
    """`VisionTransformerBackbone` kwargs of a paper model.

    Families:

    - `"vit"`: dense ViT Ti/S/B/L/H (`VIT_SIZES`), class token.
    - `"vmoe"`: V-MoE S/B/L/H (`VMOE_SIZES`, paper's Table 8): pre-logits,
      E=32, K=2, capacity factor 1.05, layout `"every2"`.
    - `"vmoe_15b"`: V-MoE-15B, MAP head (`variant` None or `"15B"`).
    - `"soft_moe"`: Soft MoE (`VIT_SIZES`): GAP, qk-norm, last half of the
      blocks, 128 experts (256 for S/14 and H/14), 1 slot.
    - `"eee"`: E³: V-MoE with `ensemble_size=2`, K=1, capacity factor 1.5,
      layout `"last2"` (`"last5"` for H/14).

    Args:
        family: one of `FAMILIES`.
        variant: `"size/patch"`, e.g. `"S/32"`, `"B/16"`, `"H/14"`.
        **overrides: any `VisionTransformerBackbone` argument, plus
            `layout` (`"every2"`, `"last2"`, `"last_half"`, `"none"`, ...;
            ignored with `moe_layers`), `num_experts`,
            `num_selected_experts`, `capacity_factor`, `batch_priority`,
            `num_slots`, `bfloat16_dispatch`, `router` (merged into the
            router config), `eval_routing`, `moe` (merged into the moe
            config), `images_per_group` (default
            `UPSTREAM_IMAGES_PER_GROUP`) or `group_size` (tokens; `None`:
            one group per call).

    Returns:
        A dict of `VisionTransformerBackbone` keyword arguments.
    """
    check_one_of(family, "family", FAMILIES)
    overrides = dict(overrides)
    valid = _backbone_arguments() | set(MOE_OVERRIDES)
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"Unknown overrides {unknown}. Valid: backbone arguments "
            f"{sorted(_backbone_arguments())} and {list(MOE_OVERRIDES)}."
        )

    size, patch, config = _paper_size(family, variant)
    config["image_size"] = 224
    moe, layout = _family_defaults(family, size, patch, config)

    # Architecture overrides first: the layout depends on num_layers.
    moe_overrides = {k: overrides.pop(k) for k in MOE_OVERRIDES if k in overrides}
    moe_update = overrides.pop("moe", None)
    config.update(overrides)
    if config.get("representation_size") == "hidden_dim":
        config["representation_size"] = config["hidden_dim"]
    moe = _override_moe(moe, moe_update, moe_overrides)
    layout = moe_overrides.get("layout", layout)
    if "moe_layers" not in overrides:
        config["moe_layers"] = moe_layers_from_layout(layout, config["num_layers"])
    config["moe_layers"] = tuple(config["moe_layers"])
    if config["moe_layers"]:
        if moe is None:
            raise ValueError(
                f"Family {family!r} is dense; pass a `moe` dict to add MoE layers."
            )
        config["moe"] = moe
    else:
        config["moe"] = None
        config.pop("ensemble_size", None)
    return config


@contextlib.contextmanager
def abstract_weights():
    """Builds layers with abstract weights: shapes only, nothing allocated
    (such a model cannot be run)."""
    with keep_uninitialized_variables():
        with keras.StatelessScope(initialize_variables=False):
            yield


_UNSET = object()


def weight_shapes(config, num_classes=None, representation_size=_UNSET):
    """`{variable.path: shape}` of the model (with a `head` of `num_classes`)
    a backbone config describes, built with `abstract_weights()`."""
    config = dict(config)
    if representation_size is not _UNSET:
        config["representation_size"] = representation_size
    with abstract_weights():
        model = VisionTransformerBackbone(**config)
        if num_classes:
            task_cls = (
                EnsembleImageClassifier if model.ensemble_size > 1 else ImageClassifier
            )
            model = task_cls(model, num_classes=num_classes, compile=False)
        return {v.path: tuple(v.shape) for v in model.weights}


def count_parameters(config, num_classes=None, representation_size=_UNSET):
    """Number of parameters of a model, counted from its abstract weights.

    Args:
        config: `VisionTransformerBackbone` kwargs.
        num_classes: int, include a classification head of this size.
        representation_size: override the pre-logits size (`None` removes it).

    Returns:
        int, the number of weights (trainable and not).

    Example:

    >>> count_parameters(backbone_config("vmoe", "S/32", layout="last2"),
    ...                  num_classes=JFT300M_CLASSES)  # Table 8: 166.7M
    166680435
    """
    shapes = weight_shapes(
        config, num_classes=num_classes, representation_size=representation_size
    )
    return sum(math.prod(shape) for shape in shapes.values())
