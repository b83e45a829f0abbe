"""Every public layer, backbone and task through the shared test base
(tests/testing.py): build, call, config round trip, jit, mixed precision,
int8 and LoRA where they apply."""

import keras
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe import layers
from keras_vmoe import models
from keras_vmoe.models import vit_embeddings
from keras_vmoe.models import vit_layers

RNG = np.random.default_rng(0)
TOKENS = RNG.normal(size=(2, 8, 16)).astype("float32")  # (B, T, D)
GROUPS = RNG.normal(size=(2, 8, 16)).astype("float32")  # (G, S, D)
IMAGES = RNG.uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")
LABELS = np.array([0, 1, 2, 1], dtype="int32")


def _routing_arrays(names):
    def arrays(routing):
        return {name: getattr(routing, name) for name in names}

    return arrays


MOE_LAYERS = [
    (layers.MoeLayer, dict(num_experts=4, hidden_dim=32,
                           router={"num_selected_experts": 2}), TOKENS),
    (layers.SoftMoE, dict(num_experts=4, hidden_dim=32, num_slots=2), TOKENS),
    (layers.PartitionedMoE, dict(num_experts=4, hidden_dim=32, num_partitions=2),
     layers.tile_for_ensemble(TOKENS, 2)),
]


def _name(value):
    return getattr(value, "__name__", "")


# The MoE layers and routers compile their routing for each check: tens of
# seconds each on two cores, so they run in the heavy group.
@pytest.mark.heavy
@pytest.mark.parametrize("cls,kwargs,x", MOE_LAYERS, ids=_name)
def test_moe_layers(cls, kwargs, x):
    testing.run_layer_test(
        cls, kwargs, x, tuple(x.shape), call_kwargs={"training": False}
    )


ROUTERS = [
    (layers.TokenChoiceRouter, dict(num_experts=4, num_selected_experts=2,
                                    capacity_factor=1.0),
     {"buffer_token": (2, 4, 4), "buffer_weight": (2, 4, 4),
      "token_expert": (2, 8, 2)}),
    # Capacity 8·1.0/4 = 2, rounded up to a multiple of 4.
    (layers.ExpertChoiceRouter, dict(num_experts=4, capacity_factor=1.0),
     {"buffer_token": (2, 4, 4), "buffer_weight": (2, 4, 4)}),
    (layers.SoftRouter, dict(num_experts=4, num_slots=2),
     {"combine_weights": (2, 8, 4, 2)}),
]


@pytest.mark.heavy
@pytest.mark.parametrize("cls,kwargs,shapes", ROUTERS, ids=_name)
def test_routers(cls, kwargs, shapes):
    testing.run_layer_test(
        cls, kwargs, GROUPS, shapes, call_kwargs={"training": False},
        output_fn=_routing_arrays(sorted(shapes)), run_mixed_precision=False,
    )


VIT_LAYERS = [
    (vit_layers.MultiHeadSelfAttention, dict(num_heads=2), TOKENS, (2, 8, 16)),
    (vit_layers.MlpBlock, dict(mlp_dim=32), TOKENS, (2, 8, 16)),
    (vit_layers.EncoderBlock, dict(num_heads=2, mlp_dim=32), TOKENS, (2, 8, 16)),
    (vit_layers.EncoderBlock, dict(num_heads=2, mlp_dim=32, moe={"num_experts": 4}),
     TOKENS, (2, 8, 16)),
    (vit_layers.MapHead, dict(num_heads=2, mlp_dim=32), TOKENS, (2, 16)),
    (vit_embeddings.PatchEmbedding, dict(hidden_dim=16, patch_size=8), IMAGES,
     (4, 17, 16)),
    (vit_embeddings.PositionEmbedding, dict(grid_size=(2, 4), kind="learned",
                                            has_class_token=False), TOKENS, (2, 8, 16)),
]


@pytest.mark.parametrize("cls,kwargs,x,shape", VIT_LAYERS, ids=_name)
def test_vit_layers(cls, kwargs, x, shape):
    testing.run_layer_test(cls, kwargs, x, shape, call_kwargs={"training": False})


BACKBONES = {
    "vit": tiny_configs.vit(),
    "vmoe": models.backbone_config("vmoe", "S/32", **tiny_configs.vit(), num_experts=4),
    "soft_moe": models.backbone_config("soft_moe", "S/16", **tiny_configs.vit(),
                                       num_experts=4),
    "tokens": tiny_configs.vit(pooled_output=False),
}


# Backbones, tasks and presets compile several models each (jit, int8, LoRA,
# one fit step): minutes on two cores, so they run in the heavy group.
@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_backbones(name):
    config = BACKBONES[name]
    width = config["hidden_dim"]
    shape = (4, 17, width) if name == "tokens" else (4, width)
    testing.run_backbone_test(models.VisionTransformerBackbone, config, IMAGES, shape)


@pytest.mark.heavy
def test_image_classifier():
    backbone = models.VisionTransformerBackbone(**BACKBONES["vmoe"])
    testing.run_task_test(
        models.ImageClassifier, {"backbone": backbone, "num_classes": 3},
        (IMAGES, LABELS), (4, 3),
    )


@pytest.mark.heavy
def test_ensemble_image_classifier():
    config = models.backbone_config("eee", "S/32", **tiny_configs.vit(), num_experts=4,
                                    layout="every2")
    backbone = models.VisionTransformerBackbone(**config)
    testing.run_task_test(
        models.EnsembleImageClassifier, {"backbone": backbone, "num_classes": 3},
        (IMAGES, LABELS), (4, 2, 3),
    )


@pytest.mark.heavy
@pytest.mark.parametrize(
    "cls,preset,shape",
    [
        (models.VisionTransformerBackbone, "vmoe_s32", (4, 32)),
        (models.ImageClassifier, "vmoe_s32", (4, 5)),
        (models.EnsembleImageClassifier, "eee_s32_last2", (4, 2, 5)),
    ],
    ids=lambda v: getattr(v, "__name__", v if isinstance(v, str) else ""),
)
def test_presets(cls, preset, shape):
    overrides = tiny_configs.preset_overrides(load_weights=False)
    if cls is not models.VisionTransformerBackbone:
        overrides["num_classes"] = 5
    testing.run_preset_test(cls, preset, IMAGES, shape, **overrides)


def test_the_base_catches_a_broken_round_trip():
    @keras.saving.register_keras_serializable(package="keras_vmoe_tests")
    class Forgetful(keras.layers.Dense):
        """Forgets its activation in `get_config`."""

        def get_config(self):
            return {**super().get_config(), "activation": "linear"}

    with pytest.raises(AssertionError):
        testing.run_layer_test(Forgetful, {"units": 3, "activation": "relu"}, TOKENS,
                               (2, 8, 3), run_mixed_precision=False)
