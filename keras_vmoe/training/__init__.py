"""Fine-tuning recipe (upstream's): SGD + momentum, warm-up + cosine, clipping.

`finetune(model, train, validation)` compiles a task with upstream's
fine-tuning recipe and runs `fit` with per-epoch checkpoints that resume
after a kill. See `finetune`.
"""

from keras_vmoe.training.recipe import finetune
from keras_vmoe.training.recipe import finetune_optimizer

__all__ = ["finetune", "finetune_optimizer"]
