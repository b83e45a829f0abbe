"""Checks and config migration of `VisionTransformerBackbone` arguments."""

from keras_vmoe.models.moe_config import validate_moe_config
from keras_vmoe.models.vit_embeddings import POSITION_EMBEDDINGS
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

CLASSIFIERS = ("token", "gap", "map")


def validate_backbone_arguments(
    image_hw,
    patch_hw,
    hidden_dim,
    num_layers,
    num_heads,
    mlp_dim,
    classifier,
    position_embedding,
    moe_layers,
    moe,
    ensemble_size,
    representation_size,
):
    """Raises a `ValueError` naming the first invalid backbone argument."""
    for axis, (size, patch) in enumerate(zip(image_hw, patch_hw, strict=True)):
        if size < 1 or patch < 1 or size % patch:
            example = max(1, size // max(patch, 1)) * patch
            raise ValueError(
                f"`image_size` must be divisible by `patch_size` (axis {axis}: "
                f"{size} % {patch} != 0). Received: image_size={image_hw}, "
                f"patch_size={patch_hw}. Valid image sizes are positive "
                f"multiples of the patch size, e.g. {example}."
            )
    for name, value in (
        ("hidden_dim", hidden_dim),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("mlp_dim", mlp_dim),
    ):
        check_int(value, name)
    if hidden_dim % num_heads:
        raise ValueError(
            f"`num_heads` must divide `hidden_dim`. Received: num_heads={num_heads}, "
            f"hidden_dim={hidden_dim}. Valid num_heads are the divisors of "
            f"{hidden_dim}."
        )
    check_one_of(classifier, "classifier", CLASSIFIERS)
    check_one_of(position_embedding, "position_embedding", POSITION_EMBEDDINGS)
    if position_embedding == "sincos2d" and (hidden_dim % 4 or hidden_dim < 8):
        raise ValueError(
            "position_embedding='sincos2d' needs `hidden_dim` to be a multiple of "
            f"4 and >= 8. Received: hidden_dim={hidden_dim}"
        )
    for index in moe_layers:
        if not 0 <= index < num_layers:
            raise ValueError(
                f"MoE block index {index} in `moe_layers` is out of range: valid "
                f"indices are 0..{num_layers - 1} for num_layers={num_layers}. "
                f"Received: moe_layers={moe_layers}"
            )
    if len(set(moe_layers)) != len(moe_layers):
        raise ValueError(
            f"`moe_layers` has duplicates. Received: moe_layers={moe_layers}"
        )
    check_int(ensemble_size, "ensemble_size")
    if moe_layers and moe is None:
        raise ValueError(
            f"`moe_layers={moe_layers}` needs a `moe` dict (at least "
            "{'num_experts': E})."
        )
    if moe is not None:
        validate_moe_config(moe, ensemble_size)
    if ensemble_size > 1 and not moe_layers:
        raise ValueError(
            f"ensemble_size={ensemble_size} (E³) needs at least one MoE block "
            "in `moe_layers`: the ensemble members are formed at the first MoE "
            "block."
        )
    check_int(representation_size, "representation_size", allow_none=True)


def check_epsilon(value, name="layer_norm_epsilon"):
    """A LayerNorm epsilon as a float > 0 (and finite), else a `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value < float("inf")):
        raise ValueError(
            f"`{name}` must be a positive number (e.g. 1e-6, or 1e-12 for "
            f"transformers ViTs). Received: {name}={value!r}")
    return float(value)


def migrate_backbone_config(config):
    """A backbone config of any released version, in the current form (older
    configs describe the pooled backbone)."""
    config = dict(config)
    config.setdefault("pooled_output", True)
    return config
