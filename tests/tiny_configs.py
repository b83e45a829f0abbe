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


_SIZES = {32: VIT, 16: VIT_16PX}


def vit(px=32, **overrides):
    """The dense ViT config: `VIT` (`px=32`) or `VIT_16PX` (`px=16`), with
    `overrides`."""
    return {**_SIZES[px], **overrides}


def vit_fresh_shapes(**overrides):
    """`vit()` with widths no other test uses (D=24, MLP 40): nothing of it is
    compiled yet when a test counts the XLA programs its build compiles."""
    return vit(hidden_dim=24, mlp_dim=40, **overrides)


def moe(num_experts=4, **settings):
    """An MoE block config (the backbone's `moe` argument): `num_experts`
    experts and the routing `settings` a test is about (`router`,
    `group_size`, ...); the layer's defaults otherwise."""
    return {"num_experts": num_experts, **settings}


def _family(family, variant, px, overrides, **defaults):
    from keras_vmoe import models

    return models.backbone_config(family, variant, **{**_SIZES[px], **defaults, **overrides})


def vit_s16(px=32, **overrides):
    """A dense ViT config with upstream's ViT defaults
    (`backbone_config("vit", "S/16")`) at the sizes of `vit(px)`, with
    `overrides`."""
    return _family("vit", "S/16", px, overrides)


def vmoe(px=32, **overrides):
    """A V-MoE config (`backbone_config("vmoe", "S/32")`, MoE in every second
    block) at the sizes of `vit(px)`, 4 experts, with `overrides`."""
    return _family("vmoe", "S/32", px, overrides, num_experts=4)


def soft_moe(px=32, **overrides):
    """A Soft MoE config (`backbone_config("soft_moe", "S/16")`) at the
    sizes of `vit(px)`, 4 experts, with `overrides`."""
    return _family("soft_moe", "S/16", px, overrides, num_experts=4)


def e3(px=32, **overrides):
    """An E³ config (`backbone_config("eee", "S/32")`, 2 members, MoE in
    every second block) at the sizes of `vit(px)`, 4 experts, with
    `overrides`."""
    return _family("eee", "S/32", px, overrides, num_experts=4, layout="every2")


def vmoe_16px_stochastic(**overrides):
    """The 16px V-MoE (`vmoe(px=16)`) with dropout 0.1 and capacity factor
    2.0: dropout and router noise draw random numbers, so seeds advance and
    the MoE block adds its auxiliary loss (the rematerialisation tests)."""
    config = vmoe(px=16, dropout_rate=0.1)
    config["moe"]["router"]["capacity_factor"] = 2.0
    return {**config, **overrides}


def vmoe_8px_micro(router="token_choice", **overrides):
    """The smallest V-MoE: 8px images, 4px patches, one MoE block of width 8
    with 2 experts, one choice per token (`router`: `"token_choice"` or
    another router name, with its defaults). For tests that fit or load
    many models (data inputs, run control)."""
    selected = {"num_selected_experts": 1} if router == "token_choice" else {}
    return {
        "image_size": 8, "patch_size": 4, "hidden_dim": 8, "num_layers": 1,
        "num_heads": 1, "mlp_dim": 8, "classifier": "token", "moe_layers": (0,),
        "moe": {"num_experts": 2, "router": {"name": router, **selected}},
        **overrides,
    }


def expert_parallel_8px(**overrides):
    """An 8px V-MoE for the 8-device tests: 4 tokens, one image per token
    group (`group_size=4`), 8 experts to split over the devices, MoE in
    block 1 of 2, top-2 routing without noise, GAP."""
    return {
        "image_size": 8, "patch_size": 4, "hidden_dim": 16, "num_layers": 2,
        "num_heads": 2, "mlp_dim": 32, "classifier": "gap", "moe_layers": (1,),
        "moe": {"num_experts": 8, "group_size": 4,
                "router": {"num_selected_experts": 2, "noise_std": 0.0}},
        **overrides,
    }


def preset_overrides(**overrides):
    """`PRESET_OVERRIDES` with `overrides`."""
    return {**PRESET_OVERRIDES, **overrides}


def vmoe_8px(router=None, **overrides):
    """The 8px V-MoE backbone config; `router` updates its router dict, or
    replaces it when it names another router (e.g. `{"name": "soft",
    "num_slots": 1}`)."""
    config = copy.deepcopy(_VMOE_8PX)
    router = dict(router or {})
    if router.get("name", "token_choice") != "token_choice":
        config["moe"]["router"] = router
    else:
        config["moe"]["router"].update(router)
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
