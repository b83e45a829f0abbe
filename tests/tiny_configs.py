"""The tiny model configurations shared by the tests.

Import with `from tiny_configs import ...` (tests/conftest.py puts this
folder on `sys.path`). Functions return fresh dicts that tests may change.
"""

import copy

# A few-thousand-parameter ViT: 32px images, 8px patches (16 tokens, +1 cls).
VIT = dict(
    image_size=32, patch_size=8, hidden_dim=32, num_layers=2, num_heads=2, mlp_dim=64
)

# The same at 16px (4 tokens, +1 cls), for tables of many small models.
VIT_16PX = dict(
    image_size=16, patch_size=8, hidden_dim=16, num_layers=2, num_heads=2, mlp_dim=32
)

# Overrides that shrink any V-MoE / E³ catalog preset to a model that builds
# and runs in about a second: 32px images, 8px patches, 4 blocks of width 32,
# MoE in blocks 1 and 3 with 4 experts.
PRESET_OVERRIDES = dict(
    hidden_dim=32,
    num_heads=2,
    mlp_dim=64,
    num_layers=4,
    num_experts=4,
    representation_size=None,
    image_size=32,
    patch_size=8,
)

# An 8px V-MoE (4 tokens, +1 cls) with one Token Choice MoE block: the
# training, data-pipeline and command-line tests fit it for a few steps.
_VMOE_8PX = {
    "image_size": 8, "patch_size": 4, "hidden_dim": 16, "num_layers": 2,
    "num_heads": 2, "mlp_dim": 32, "classifier": "token", "moe_layers": (1,),
    "moe": {"num_experts": 4, "identical_init": False,
            "router": {"name": "token_choice", "num_selected_experts": 2,
                       "capacity_factor": 2.0}},
}


def vit(**overrides):
    """`VIT` with `overrides`."""
    return {**VIT, **overrides}


def preset_overrides(**overrides):
    """`PRESET_OVERRIDES` with `overrides`."""
    return {**PRESET_OVERRIDES, **overrides}


def vmoe_8px(router=None, **overrides):
    """The 8px V-MoE backbone config; `router` updates its router dict."""
    config = copy.deepcopy(_VMOE_8PX)
    config["moe"]["router"].update(router or {})
    config.update(overrides)
    return config


def composition_model(kind, seed=0):
    """A `VIT_16PX` task of one kind with every weight drawn N(0, 0.3).

    `kind`: `"sparse"` (V-MoE: Token Choice, capacity factor 2.0, class
    token), `"soft"` (Soft MoE: 2 slots per expert, GAP) or `"ensemble"`
    (E³: `backbone_config("eee", ...)`, 2 members). One MoE block (block
    1) of 4 experts, 3 classes. Random weights everywhere, the head
    included (a zero head would move no logit). Shared by the composition
    tests (tests/test_composition.py, tests/backends/test_lora_int8.py).
    """
    import keras
    import numpy as np

    from keras_vmoe import models

    keras.utils.set_random_seed(seed)
    if kind == "ensemble":
        config = models.backbone_config("eee", "S/32", **VIT_16PX, layout="every2",
                                        num_experts=4, representation_size=None)
        model = models.EnsembleImageClassifier(
            models.VisionTransformerBackbone(**config), num_classes=3)
    else:
        moe = ({"num_experts": 4, "router": {"name": "token_choice", "capacity_factor": 2.0}}
               if kind == "sparse"
               else {"num_experts": 4, "router": {"name": "soft", "num_slots": 2}})
        model = models.ImageClassifier(models.VisionTransformerBackbone(
            **VIT_16PX, classifier="token" if kind == "sparse" else "gap",
            moe_layers=(1,), moe=moe), num_classes=3)
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.3, w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    return model


def vmoe_16px_classifier():
    """A `VIT_16PX` V-MoE classifier (4 experts, 3 classes), random weights:
    the model the layer tests pass routing settings to."""
    from keras_vmoe import models

    config = models.backbone_config("vmoe", "S/32", **VIT_16PX, num_experts=4)
    return models.ImageClassifier(models.VisionTransformerBackbone(**config), num_classes=3)


def tiny_moe_layer():
    """An unbuilt `MoeLayer`: 4 experts of MLP size 8, top-2 Token Choice."""
    from keras_vmoe.layers import MoeLayer

    return MoeLayer(4, 8, router={"name": "token_choice", "num_selected_experts": 2})


def e3_16px_classifier(num_classes=4):
    """A 16-pixel E³ classifier (2 blocks, 4 experts, 2 members,
    representation size 8, zero head bias), seeded."""
    import keras

    from keras_vmoe import models

    keras.utils.set_random_seed(0)
    config = models.backbone_config(
        "eee", "S/32", image_size=16, patch_size=8, hidden_dim=16, num_heads=2,
        mlp_dim=32, num_layers=2, layout="every2", num_experts=4,
        representation_size=8)
    return models.EnsembleImageClassifier(
        models.VisionTransformerBackbone(**config), num_classes=num_classes,
        head_bias_init=0.0)
