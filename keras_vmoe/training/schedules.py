"""Upstream's learning-rate schedules (`vmoe/train/schedule.py`) for Keras.

Both start at 0, rise linearly to `peak` over `warmup_steps` and decay to
`end_learning_rate` at `total_steps` (then stay there); the step count
starts at 0, as optax's.
"""

import math

import keras
from keras import ops

from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_number


class _WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0, then a decay to `end_learning_rate`.

    Args (of every subclass):
        learning_rate: peak learning rate.
        total_steps: int, the schedule's length (warm-up included).
        warmup_steps: int < `total_steps`.
        end_learning_rate: final learning rate.
    """

    def __init__(self, learning_rate, total_steps, warmup_steps, end_learning_rate=1e-5):
        self.learning_rate = check_number(learning_rate, "learning_rate")
        self.end_learning_rate = check_number(end_learning_rate, "end_learning_rate")
        self.total_steps = check_int(total_steps, "total_steps")
        self.warmup_steps = check_int(warmup_steps, "warmup_steps", minimum=0)
        if warmup_steps >= total_steps:
            raise ValueError(
                f"`warmup_steps` ({warmup_steps}) must be smaller than the number "
                f"of training steps ({total_steps}).")

    def _decay(self, fraction):
        raise NotImplementedError

    def __call__(self, step):
        step = ops.cast(step, "float32")
        peak, end = self.learning_rate, self.end_learning_rate
        warmup = float(self.warmup_steps)
        decay_steps = float(self.total_steps - self.warmup_steps)
        fraction = ops.clip((step - warmup) / decay_steps, 0.0, 1.0)
        decayed = end + (peak - end) * self._decay(fraction)
        if not self.warmup_steps:
            return decayed
        return ops.where(step < warmup, peak * step / warmup, decayed)

    def get_config(self):
        return {"learning_rate": self.learning_rate, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps,
                "end_learning_rate": self.end_learning_rate}


@keras.saving.register_keras_serializable(package="keras_vmoe")
class WarmupCosineDecay(_WarmupDecay):
    """Linear warm-up from 0, then cosine decay to `end_learning_rate`.

    Upstream's `warmup_cosine_decay` (`vmoe/train/schedule.py:33-34`).
    Arguments as `_WarmupDecay`.
    """

    def _decay(self, fraction):
        return 0.5 * (1.0 + ops.cos(math.pi * fraction))


@keras.saving.register_keras_serializable(package="keras_vmoe")
class WarmupLinearDecay(_WarmupDecay):
    """Linear warm-up from 0, then linear decay to `end_learning_rate`.

    Upstream's `warmup_linear_decay` (`vmoe/train/schedule.py:35-36`,
    `:45-57`), the pre-training schedule. Arguments as `_WarmupDecay`.
    """

    def _decay(self, fraction):
        return 1.0 - fraction
