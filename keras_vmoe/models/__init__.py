"""Vision Transformer models with MoE layers: the backbone and the tasks.

Building blocks (`vit_layers`, `vit_embeddings`), paper configs (`configs`),
features and routing tools are imported from their modules.
"""

from keras_vmoe.models.backbone import Backbone
from keras_vmoe.models.configs import backbone_config
from keras_vmoe.models.configs import count_parameters
from keras_vmoe.models.ensemble_classifier import EnsembleAccuracy
from keras_vmoe.models.ensemble_classifier import EnsembleCrossentropy
from keras_vmoe.models.ensemble_classifier import EnsembleImageClassifier
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.image_classifier_preprocessor import ImageClassifierPreprocessor
from keras_vmoe.models.task import Task
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone

__all__ = [
    "Backbone",
    "EnsembleAccuracy",
    "EnsembleCrossentropy",
    "EnsembleImageClassifier",
    "ImageClassifier",
    "ImageClassifierPreprocessor",
    "Task",
    "VisionTransformerBackbone",
    "backbone_config",
    "count_parameters",
]
