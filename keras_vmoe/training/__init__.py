"""Training: upstream's recipes as data, their optimizers, and `finetune`."""

from keras_vmoe.training.checkpoints import CheckpointError
from keras_vmoe.training.finetuning import finetune
from keras_vmoe.training.recipes import RECIPES
from keras_vmoe.training.recipes import Recipe
from keras_vmoe.training.recipes import SigmoidCrossentropy
from keras_vmoe.training.recipes import SmoothedCrossentropy
from keras_vmoe.training.recipes import UpstreamAdam
from keras_vmoe.training.recipes import UpstreamSGD
from keras_vmoe.training.recipes import build_optimizer
from keras_vmoe.training.recipes import compile_model
from keras_vmoe.training.recipes import get_recipe
from keras_vmoe.training.recipes import set_routing
from keras_vmoe.training.run_control import NonFiniteLossError
from keras_vmoe.training.run_control import TrainingInterrupted
from keras_vmoe.training.schedules import WarmupCosineDecay
from keras_vmoe.training.schedules import WarmupLinearDecay

__all__ = [
    "RECIPES",
    "CheckpointError",
    "NonFiniteLossError",
    "Recipe",
    "SigmoidCrossentropy",
    "SmoothedCrossentropy",
    "TrainingInterrupted",
    "UpstreamAdam",
    "UpstreamSGD",
    "WarmupCosineDecay",
    "WarmupLinearDecay",
    "build_optimizer",
    "compile_model",
    "finetune",
    "get_recipe",
    "set_routing",
]
