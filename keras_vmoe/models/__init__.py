"""Vision Transformer models with MoE layers: the backbone and the tasks.

`Backbone` and `Task` are the bases (presets, LoRA, quantization, the
input path of `fit`/`predict`); `VisionTransformerBackbone`,
`ImageClassifier` and `EnsembleImageClassifier` subclass them.

Building blocks (`keras_vmoe.models.vit_layers`, `vit_embeddings`), paper
configs (`configs`), features (`features`) and routing tools
(`routing_control`, `routing_analysis`) are imported from their modules.
"""

from keras_vmoe._lazy import deprecated_exports
from keras_vmoe.models.backbone import Backbone
from keras_vmoe.models.configs import backbone_config
from keras_vmoe.models.configs import count_parameters
from keras_vmoe.models.ensemble_classifier import EnsembleAccuracy
from keras_vmoe.models.ensemble_classifier import EnsembleCrossentropy
from keras_vmoe.models.ensemble_classifier import EnsembleImageClassifier
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.task import Task
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone

__all__ = [
    "Backbone",
    "EnsembleAccuracy",
    "EnsembleCrossentropy",
    "EnsembleImageClassifier",
    "ImageClassifier",
    "Task",
    "VisionTransformerBackbone",
    "backbone_config",
    "count_parameters",
]

_CONFIGS = "keras_vmoe.models.configs"
_ENSEMBLE = "keras_vmoe.models.ensemble_classifier"
_VIT_LAYERS = "keras_vmoe.models.vit_layers"
_EMBEDDINGS = "keras_vmoe.models.vit_embeddings"
# Names this package exported before; they keep working for one release.
DEPRECATED = {
    "FAMILIES": _CONFIGS,
    "JFT300M_CLASSES": _CONFIGS,
    "JFT4B_CLASSES": _CONFIGS,
    "SOFT_MOE_SIZES": _CONFIGS,
    "VIT_SIZES": _CONFIGS,
    "VMOE_15B_SIZE": _CONFIGS,
    "VMOE_SIZES": _CONFIGS,
    "abstract_weights": _CONFIGS,
    "moe_layers_every": _CONFIGS,
    "moe_layers_from_layout": _CONFIGS,
    "moe_layers_last": _CONFIGS,
    "parse_variant": _CONFIGS,
    "weight_shapes": _CONFIGS,
    "ensemble_accuracy": _ENSEMBLE,
    "ensemble_log_probabilities": _ENSEMBLE,
    "ensemble_probabilities": _ENSEMBLE,
    "DenseGeneralInitializer": _VIT_LAYERS,
    "EncoderBlock": _VIT_LAYERS,
    "MapHead": _VIT_LAYERS,
    "MlpBlock": _VIT_LAYERS,
    "MultiHeadSelfAttention": _VIT_LAYERS,
    "make_moe_layer": "keras_vmoe.models.moe_config",
    "PatchEmbedding": _EMBEDDINGS,
    "PositionEmbedding": _EMBEDDINGS,
    "resize_position_embedding": _EMBEDDINGS,
    "sincos2d_position_embedding": _EMBEDDINGS,
    # Upcycling reads presets and vit_jax files, above the models.
    "upcycle": "keras_vmoe.presets.upcycling",
}

__getattr__ = deprecated_exports(__name__, DEPRECATED)
