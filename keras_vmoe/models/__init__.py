"""Vision Transformer models with MoE layers: backbone, tasks, paper configs."""

from keras_vmoe._lazy import lazy_exports
from keras_vmoe.models.configs import FAMILIES
from keras_vmoe.models.configs import JFT4B_CLASSES
from keras_vmoe.models.configs import JFT300M_CLASSES
from keras_vmoe.models.configs import SOFT_MOE_SIZES
from keras_vmoe.models.configs import VIT_SIZES
from keras_vmoe.models.configs import VMOE_15B_SIZE
from keras_vmoe.models.configs import VMOE_SIZES
from keras_vmoe.models.configs import abstract_weights
from keras_vmoe.models.configs import backbone_config
from keras_vmoe.models.configs import count_parameters
from keras_vmoe.models.configs import moe_layers_every
from keras_vmoe.models.configs import moe_layers_from_layout
from keras_vmoe.models.configs import moe_layers_last
from keras_vmoe.models.configs import parse_variant
from keras_vmoe.models.configs import weight_shapes
from keras_vmoe.models.ensemble_classifier import EnsembleAccuracy
from keras_vmoe.models.ensemble_classifier import EnsembleCrossentropy
from keras_vmoe.models.ensemble_classifier import EnsembleImageClassifier
from keras_vmoe.models.ensemble_classifier import ensemble_accuracy
from keras_vmoe.models.ensemble_classifier import ensemble_log_probabilities
from keras_vmoe.models.ensemble_classifier import ensemble_probabilities
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone
from keras_vmoe.models.vit_layers import DenseGeneralInitializer
from keras_vmoe.models.vit_layers import EncoderBlock
from keras_vmoe.models.vit_layers import MapHead
from keras_vmoe.models.vit_layers import MlpBlock
from keras_vmoe.models.vit_layers import MultiHeadSelfAttention
from keras_vmoe.models.vit_layers import PatchEmbedding
from keras_vmoe.models.vit_layers import PositionEmbedding
from keras_vmoe.models.vit_layers import make_moe_layer
from keras_vmoe.models.vit_layers import resize_position_embedding
from keras_vmoe.models.vit_layers import sincos2d_position_embedding

__all__ = [
    "FAMILIES",
    "JFT300M_CLASSES",
    "JFT4B_CLASSES",
    "SOFT_MOE_SIZES",
    "VIT_SIZES",
    "VMOE_15B_SIZE",
    "VMOE_SIZES",
    "DenseGeneralInitializer",
    "EncoderBlock",
    "EnsembleAccuracy",
    "EnsembleCrossentropy",
    "EnsembleImageClassifier",
    "ImageClassifier",
    "MapHead",
    "MlpBlock",
    "MultiHeadSelfAttention",
    "PatchEmbedding",
    "PositionEmbedding",
    "VisionTransformerBackbone",
    "abstract_weights",
    "backbone_config",
    "count_parameters",
    "ensemble_accuracy",
    "ensemble_log_probabilities",
    "ensemble_probabilities",
    "make_moe_layer",
    "moe_layers_every",
    "moe_layers_from_layout",
    "moe_layers_last",
    "parse_variant",
    "resize_position_embedding",
    "sincos2d_position_embedding",
    "upcycle",
    "weight_shapes",
]

# `upcycle` reads presets and vit_jax files, which sit above the models
# (README, "Package layers"): imported on first use.
__getattr__, __dir__ = lazy_exports(__name__, {"upcycle": "keras_vmoe.models.upcycle"})
