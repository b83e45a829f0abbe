"""Old import paths keep working: routers and ViT layers in their old
modules (and configs that record those modules), and the names that left the
`keras_vmoe.models` face, with a `DeprecationWarning` naming the new path."""

import importlib
import json
import re
import warnings

import keras
import pytest

from keras_vmoe.layers.routing import ExpertChoiceRouter
from keras_vmoe.layers.routing import PartitionedTokenChoiceRouter
from keras_vmoe.layers.routing import SoftRouter
from keras_vmoe.layers.routing import TokenChoiceRouter
from keras_vmoe.models.vit_embeddings import PatchEmbedding
from keras_vmoe.models.vit_embeddings import PositionEmbedding

OLD_NAMES = {
    "keras_vmoe.layers.routing": [
        "MAX_ITERATIONS", "ROUTERS", "ExpertChoiceRouter",
        "PartitionedTokenChoiceRouter", "Router", "Routing", "SoftRouter",
        "TokenChoiceRouter", "check_router", "finite_logits", "get_router",
    ],
    "keras_vmoe.models.vit_layers": [
        "LAYER_NORM_EPSILON", "MOE_KEYS", "MOE_TYPES", "POSITION_EMBEDDINGS",
        "DenseGeneralInitializer", "EncoderBlock", "MapHead", "MlpBlock",
        "MultiHeadSelfAttention", "PatchEmbedding", "PositionEmbedding",
        "make_moe_layer", "resize_position_embedding",
        "sincos2d_position_embedding", "validate_moe_config", "_to_pair",
    ],
}


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_the_old_import_paths_still_work(module):
    imported = importlib.import_module(module)
    missing = [name for name in OLD_NAMES[module] if not hasattr(imported, name)]
    assert not missing


@pytest.mark.parametrize(
    "layer, old_module",
    [
        (TokenChoiceRouter(4, num_selected_experts=2), "keras_vmoe.layers.routing"),
        (PartitionedTokenChoiceRouter(4, num_partitions=2), "keras_vmoe.layers.routing"),
        (ExpertChoiceRouter(4, affinity="sinkhorn"), "keras_vmoe.layers.routing"),
        (SoftRouter(4, num_slots=2), "keras_vmoe.layers.routing"),
        (PatchEmbedding(8, 4), "keras_vmoe.models.vit_layers"),
        (PositionEmbedding(2, "sincos2d"), "keras_vmoe.models.vit_layers"),
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, str) else "",
)
def test_configs_that_record_the_old_module_still_load(layer, old_module):
    config = keras.saving.serialize_keras_object(layer)
    assert config["registered_name"] == f"keras_vmoe>{type(layer).__name__}"
    assert config["module"] != old_module  # the class did move
    config["module"] = old_module  # as saved before the move
    loaded = keras.saving.deserialize_keras_object(json.loads(json.dumps(config)))
    assert type(loaded) is type(layer)
    assert loaded.get_config() == layer.get_config()


@pytest.mark.parametrize("name", ["EncoderBlock", "VIT_SIZES", "moe_layers_every",
                                  "ensemble_probabilities", "PatchEmbedding"])
def test_names_that_left_the_models_face_warn_and_work(name):
    import keras_vmoe.models as models

    target = models.DEPRECATED[name]
    with pytest.warns(DeprecationWarning, match=f"{target}.{name}"):
        value = getattr(models, name)
    assert value is getattr(importlib.import_module(target), name)


def test_the_models_face_exports_what_users_call():
    import keras_vmoe.models as models

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in models.__all__:
            assert getattr(models, name) is not None
    assert not set(models.__all__) & set(models.DEPRECATED)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        models.Nothing  # noqa: B018


@pytest.mark.parametrize("name", ["MOE_KEYS", "PatchEmbedding", "_to_pair", "make_moe_layer"])
def test_names_that_left_vit_layers_warn_with_the_new_path(name):
    from keras_vmoe.models import vit_layers

    with pytest.warns(DeprecationWarning, match=r"vit_layers\..*(moe_config|vit_embeddings)"):
        assert getattr(vit_layers, name) is not None


def test_renamed_routing_and_feature_functions_warn():
    from keras_vmoe import evaluation
    from keras_vmoe.layers import MoeLayer

    with pytest.warns(DeprecationWarning, match=r"evaluation\.extract_features.*pooled_features"):
        assert evaluation.extract_features is evaluation.pooled_features
    layer = MoeLayer(4, 8)
    with pytest.warns(DeprecationWarning, match=r"MoeLayer\.update_routing.*set_routing"):
        layer.update_routing(capacity_factor=2.0)
    assert layer.capacity_factor == 2.0


def test_apply_routing_is_set_routing():
    from keras_vmoe import training
    from keras_vmoe.training import recipes

    with pytest.warns(DeprecationWarning, match=r"training\.apply_routing.*"
                                                r"keras_vmoe\.training\.set_routing"):
        assert training.apply_routing is recipes.set_routing
    model = keras.Sequential()  # no MoE layers: returned unchanged
    with pytest.warns(DeprecationWarning, match=r"training\.apply_routing.*"
                                                r"keras_vmoe\.training\.set_routing"):
        assert recipes.apply_routing(model, "digits") is model


@pytest.mark.heavy
def test_token_assignments_left_the_layer_for_the_routing_analysis():
    import numpy as np

    from keras_vmoe.layers import MoeLayer
    from keras_vmoe.models import routing_analysis

    layer = MoeLayer(4, 8, router={"num_selected_experts": 2})
    x = keras.random.normal((2, 6, 4), seed=1)
    _, routing = layer(x, return_routing=True)
    with pytest.warns(DeprecationWarning, match=r"MoeLayer\.token_assignments.*"
                                                r"routing_analysis\.token_assignments"):
        old = layer.token_assignments(routing, (2, 6, 4))
    new = routing_analysis.token_assignments(layer, routing, (2, 6, 4))
    assert sorted(old) == sorted(new) == ["processed", "requested"]
    np.testing.assert_array_equal(old["processed"], new["processed"])


@pytest.mark.parametrize("face,name,new", [
    ("formats", "restore_flat", "keras_vmoe.formats.partitioned.restore_flat"),
    ("evaluation", "log_softmax", "keras_vmoe.evaluation.metrics.log_softmax"),
    ("training", "finetune_optimizer", "keras_vmoe.training.finetuning.finetune_optimizer"),
    ("layers", "get_router", "keras_vmoe.layers.routing.get_router"),
    ("conversion", "conversion_plan", "keras_vmoe.conversion.weights.conversion_plan"),
    ("deploy", "weight_bytes", "keras_vmoe.deploy.quantize.weight_bytes"),
    ("presets", "PRESETS", "keras_vmoe.catalog.PRESETS"),
    ("distribution", "pod_parallel", 'make_distribution("pod", mesh)'),
])
def test_names_that_left_a_face_warn_and_still_work(face, name, new):
    module = importlib.import_module(f"keras_vmoe.{face}")
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        assert getattr(module, name) is not None
    assert name not in module.__all__
