"""Fine-tuning recipe (upstream's): SGD + momentum, warm-up + cosine, clipping.

`finetune(model, train, validation)` compiles a task with upstream's
fine-tuning recipe and runs `fit`: Ctrl-C/SIGTERM stop it after the
current step with its state saved, atomic checkpoints resume it exactly
after a kill, and a non-finite loss stops it. See `finetune`.
"""

from keras_vmoe.training.checkpoints import CheckpointError
from keras_vmoe.training.recipe import finetune
from keras_vmoe.training.recipe import finetune_optimizer
from keras_vmoe.training.run_control import NonFiniteLossError
from keras_vmoe.training.run_control import TrainingInterrupted

__all__ = ["CheckpointError", "NonFiniteLossError", "TrainingInterrupted",
           "finetune", "finetune_optimizer"]
