"""Training recipes as data: upstream's configs, transcribed field by field.

A `Recipe` holds everything a published number depends on and cites the
upstream file and lines (google-research/vmoe at 942a78b). `UpstreamSGD`
and `UpstreamAdam` follow upstream's optax chains (docs/guides/finetuning.md).
"""

import dataclasses
import math
import re

import keras
from keras import ops

from keras_vmoe.models.ensemble_classifier import EnsembleAccuracy
from keras_vmoe.models.ensemble_classifier import EnsembleCrossentropy
from keras_vmoe.models.ensemble_classifier import EnsembleImageClassifier
from keras_vmoe.training.schedules import WarmupCosineDecay
from keras_vmoe.training.schedules import WarmupLinearDecay
from keras_vmoe.utils.validation import check_number
from keras_vmoe.utils.validation import check_probability

UPSTREAM = "google-research/vmoe@942a78b"


def _check_learning_rate(learning_rate):
    """A number learning rate must be finite and > 0 (schedules pass through)."""
    if not callable(learning_rate):
        check_number(learning_rate, "learning_rate", inclusive=False)


class _SlotOptimizer(keras.optimizers.Optimizer):
    """Slots per variable (`SLOTS`: slot name -> attribute) and `CONFIG` fields."""

    SLOTS = {}
    CONFIG = ()

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        for slot, attribute in self.SLOTS.items():
            setattr(self, attribute, [self.add_variable_from_reference(v, name=slot)
                                      for v in variables])

    def get_config(self):
        return {**super().get_config(),
                **{name: getattr(self, name) for name in self.CONFIG}}


@keras.saving.register_keras_serializable(package="keras_vmoe")
class UpstreamSGD(_SlotOptimizer):
    """SGD with optax's `trace` momentum: `v = g + m·v`, `w -= lr_t·v`.

    Unlike Keras' `SGD` (`v = m·v - lr_t·g`), the current learning rate
    scales the whole velocity, as upstream's `trace(m)`, `scale(-lr_t)`.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        momentum: float in [0, 1).
        **kwargs: `keras.optimizers.Optimizer` arguments.

    Examples:

    ```python
    import keras_vmoe

    optimizer = keras_vmoe.training.UpstreamSGD(0.01, momentum=0.9,
                                                global_clipnorm=10.0)
    ```
    """

    SLOTS = {"velocity": "velocities"}
    CONFIG = ("momentum",)

    def __init__(self, learning_rate=0.01, momentum=0.9, name="upstream_sgd",
                 **kwargs):
        _check_learning_rate(learning_rate)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = check_probability(momentum, "momentum", include_one=False)

    def update_step(self, gradient, variable, learning_rate):
        learning_rate = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        velocity = self.velocities[self._get_variable_index(variable)]
        self.assign(velocity, ops.add(gradient, ops.multiply(velocity, self.momentum)))
        self.assign_sub(variable, ops.multiply(velocity, learning_rate))


# Upstream's `('.*/kernel', wd)`: every Dense, Conv, attention, router and
# expert kernel; not biases, norms, embeddings, `cls`, Soft MoE's `mu`/`scale`.
KERNEL_PATTERN = r"(^|/)kernel(_[0-9]+)?$"


@keras.saving.register_keras_serializable(package="keras_vmoe")
class UpstreamAdam(_SlotOptimizer):
    """Adam as optax's `scale_by_adam`, with upstream's kernel-only decay.

    `u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`, then
    `w -= lr_t·(u + wd·w)`: epsilon after the bias correction (Keras adds
    it before), and weight decay only on variables matching `decay_pattern`.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        beta_1: float in [0, 1), the first-moment decay.
        beta_2: float in [0, 1), the second-moment decay.
        epsilon: float > 0, added after the bias correction.
        weight_decay: float >= 0 or None, decoupled weight decay (times
            the learning rate) of the variables matching `decay_pattern`.
        decay_pattern: regular expression searched in each variable's `path`.
        **kwargs: `keras.optimizers.Optimizer` arguments.

    Examples:

    ```python
    import keras_vmoe

    optimizer = keras_vmoe.training.UpstreamAdam(
        1e-3, weight_decay=0.1, global_clipnorm=1.0)
    ```
    """

    SLOTS = {"momentum": "_momentums", "velocity": "_velocities"}
    CONFIG = ("beta_1", "beta_2", "epsilon", "decay_pattern")

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-8,
                 weight_decay=None, decay_pattern=KERNEL_PATTERN,
                 name="upstream_adam", **kwargs):
        _check_learning_rate(learning_rate)
        beta_1 = check_probability(beta_1, "beta_1", include_one=False)
        beta_2 = check_probability(beta_2, "beta_2", include_one=False)
        check_number(epsilon, "epsilon", inclusive=False)
        if weight_decay is not None:
            weight_decay = check_number(weight_decay, "weight_decay")
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay,
                         name=name, **kwargs)
        try:
            re.compile(decay_pattern)
        except (TypeError, re.error) as error:
            raise ValueError(
                "`decay_pattern` must be a regular expression (searched in each "
                f"variable's path). Received: decay_pattern={decay_pattern!r} "
                f"({error})") from None
        self.beta_1, self.beta_2 = beta_1, beta_2
        self.epsilon = float(epsilon)
        self.decay_pattern = decay_pattern

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # TensorFlow decays the raw tf.Variable (no Keras path): key by id.
        self._decayed_keys = {
            self._var_key(v) for v in variables
            if re.search(self.decay_pattern, v.path) is not None}

    def _use_weight_decay(self, variable):
        if hasattr(self, "_decayed_keys"):
            decayed = self._var_key(variable) in self._decayed_keys
        else:
            path = getattr(variable, "path", variable.name)
            decayed = re.search(self.decay_pattern, path) is not None
        return decayed and super()._use_weight_decay(variable)

    def update_step(self, gradient, variable, learning_rate):
        learning_rate = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        step = ops.cast(self.iterations + 1, variable.dtype)
        beta_1 = ops.cast(self.beta_1, variable.dtype)
        beta_2 = ops.cast(self.beta_2, variable.dtype)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        self.assign(m, ops.add(ops.multiply(m, beta_1),
                               ops.multiply(gradient, 1.0 - beta_1)))
        self.assign(v, ops.add(ops.multiply(v, beta_2),
                               ops.multiply(ops.square(gradient), 1.0 - beta_2)))
        m_hat = ops.divide(m, 1.0 - ops.power(beta_1, step))
        v_hat = ops.divide(v, 1.0 - ops.power(beta_2, step))
        update = ops.divide(m_hat, ops.add(ops.sqrt(v_hat), self.epsilon))
        self.assign_sub(variable, ops.multiply(update, learning_rate))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training recipe, transcribed from an upstream config.

    Attributes:
        name: the recipe's name (`get_recipe(name)`).
        source: the upstream config file and lines it transcribes.
        reproduces: the paper table / number it reproduces.
        optimizer: `"sgd"` (`UpstreamSGD`) or `"adam"` (`UpstreamAdam`).
        learning_rate, end_learning_rate: peak and last-step learning rates.
        schedule: `"warmup_cosine_decay"` or `"warmup_linear_decay"`.
        warmup_steps, train_steps: linear warm-up (from 0) and total steps.
        train_epochs: epochs, for configs that count epochs (pre-training).
        batch_size: images per step.
        momentum: SGD momentum.
        adam_b1, adam_b2: Adam betas.
        weight_decay: decoupled weight decay of the kernels; 0 for none.
        clip_global_norm: gradient clip by global norm, or None.
        loss: `"softmax_xent"`, `"sigmoid_xent"` (multi-label) or
            `"ensemble_softmax_xent"` (E³: mean member cross-entropy).
        label_smoothing: label smoothing.
        train_capacity_factor, eval_capacity_factor: capacity factors for
            training and evaluation (None: keep the model's).
        images_per_group: images routed together in both phases (E³: with
            their N member copies); None: the model keeps its groups.
        expert_dropout: dropout in the expert MLPs.
        representation_size: the pre-logits layer size, or None.
        image_size: training and evaluation resolution.
        train_preprocessing: upstream's training pipe (for reference).
        eval_preprocessing: `"resize"` or `"resize_small_central_crop"`.
        randaugment: `(num_ops, magnitude)` or None.
        mixup: MixUp concentration, or None.
        dataset: the TFDS dataset and splits upstream uses.
        remat, scan: bool, train with rematerialised / scanned (JAX) encoder
            blocks; None: keep the model's setting.
    """

    name: str
    source: str
    reproduces: str
    optimizer: str
    learning_rate: float
    end_learning_rate: float
    schedule: str
    warmup_steps: int
    train_steps: int
    batch_size: int
    clip_global_norm: float = None
    momentum: float = 0.9
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    weight_decay: float = 0.0
    loss: str = "softmax_xent"
    label_smoothing: float = 0.0
    train_capacity_factor: float = None
    eval_capacity_factor: float = None
    images_per_group: int = 8
    expert_dropout: float = 0.0
    representation_size: int = None
    image_size: int = 224
    train_preprocessing: str = ""
    eval_preprocessing: str = "resize"
    randaugment: tuple = None
    mixup: float = None
    dataset: str = ""
    train_epochs: int = None
    remat: bool = None
    scan: bool = None

    def __post_init__(self):
        # Checked here so that `dataclasses.replace(recipe, ...)` is checked too.
        def fail(field, valid):
            raise ValueError(
                f"Recipe {self.name!r}: `{field}` must be {valid}. Received: "
                f"{field}={getattr(self, field)!r}")

        def number(field):
            value = getattr(self, field)
            return (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value))

        def count(field):
            value = getattr(self, field)
            return isinstance(value, int) and not isinstance(value, bool)

        for field, valid in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                             ("loss", LOSSES)):
            if getattr(self, field) not in valid:
                fail(field, f"one of {list(valid)}")
        if not number("learning_rate") or self.learning_rate <= 0:
            fail("learning_rate", "a finite number > 0")
        if not number("end_learning_rate") or not (
                0 <= self.end_learning_rate <= self.learning_rate):
            fail("end_learning_rate",
                 f"a number in [0, learning_rate={self.learning_rate!r}]")
        if not count("train_steps") or self.train_steps < 1:
            fail("train_steps", "an int >= 1")
        if not count("warmup_steps") or not 0 <= self.warmup_steps < self.train_steps:
            fail("warmup_steps", f"an int in [0, train_steps={self.train_steps})")
        if not count("batch_size") or self.batch_size < 1:
            fail("batch_size", "an int >= 1")
        for field in ("clip_global_norm", "train_capacity_factor",
                      "eval_capacity_factor", "mixup"):
            if getattr(self, field) is not None and (
                    not number(field) or getattr(self, field) <= 0):
                fail(field, "a finite number > 0, or None")
        for field in ("momentum", "adam_b1", "adam_b2", "label_smoothing",
                      "expert_dropout"):
            if not number(field) or not 0 <= getattr(self, field) < 1:
                fail(field, "a number in [0, 1)")
        if not number("weight_decay") or self.weight_decay < 0:
            fail("weight_decay", "a finite number >= 0")
        for field in ("remat", "scan"):
            if not (getattr(self, field) is None or isinstance(getattr(self, field), bool)):
                fail(field, "True, False or None (keep the model's setting)")
        if self.images_per_group is not None and (
                not count("images_per_group") or self.images_per_group < 1):
            fail("images_per_group", "an int >= 1, or None (keep the model's groups)")

    def to_dict(self):
        """The recipe as a JSON-friendly dict."""
        return dataclasses.asdict(self)


OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("warmup_cosine_decay", "warmup_linear_decay")
LOSSES = ("softmax_xent", "sigmoid_xent", "ensemble_softmax_xent")


_FT = "vmoe/configs/vmoe_paper/"

RECIPES = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            name="vmoe_ft_imagenet",
            source=(f"{UPSTREAM} {_FT}vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_"
                    "ilsvrc2012.py: batch/classes/size :41-43, preprocessing "
                    ":53-72, loss :75, steps :77, optimizer :101-112, "
                    "representation_size None and capacity 1.5 :152-153; group "
                    "of 8 images common.py:206-208"),
            reproduces=("V-MoE paper Table 7 ImageNet row (10k steps); config "
                        "docstring :25-29: S/32 light1 val 78.8 / test 75.9 / "
                        "ReaL 77.1 / v2 62.0 (B/16: 85.6 test)"),
            optimizer="sgd", learning_rate=0.003, end_learning_rate=1e-5,
            schedule="warmup_cosine_decay", warmup_steps=500, train_steps=10_000,
            batch_size=1024, clip_global_norm=10.0, momentum=0.9,
            train_capacity_factor=1.5, eval_capacity_factor=1.5, images_per_group=8,
            expert_dropout=0.0, representation_size=None, image_size=384,
            train_preprocessing="decode_jpeg_and_inception_crop(384)|flip_lr",
            eval_preprocessing="resize", dataset="imagenet2012 train[:99%] / validation",
        ),
        Recipe(
            name="vmoe_ft_cifar10",
            source=(f"{UPSTREAM} {_FT}vmoe_b16_imagenet21k_randaug_strong_ft_cifar10.py:"
                    " batch/classes/size :33-35, preprocessing :46-65, loss :68, "
                    "steps :70, optimizer :92-103, representation_size None and "
                    "capacity 1.5 :130-131"),
            reproduces="V-MoE B/16 CIFAR-10 fine-tune, config docstring :18: 98.7% test",
            optimizer="sgd", learning_rate=0.0015, end_learning_rate=1e-5,
            schedule="warmup_cosine_decay", warmup_steps=100, train_steps=1_000,
            batch_size=1024, clip_global_norm=10.0, momentum=0.9,
            train_capacity_factor=1.5, eval_capacity_factor=1.5, images_per_group=8,
            representation_size=None, image_size=128,
            train_preprocessing="decode|inception_crop(128)|flip_lr",
            eval_preprocessing="resize", dataset="cifar10 train[:98%] / test",
        ),
        Recipe(
            name="e3_ft_cifar100",
            source=("google-research/vmoe@942a78b vmoe/configs/eee_paper/eee_s32_last2_"
                    "ilsvrc2012_ft_cifar100.py: batch/classes/size :35-37, group "
                    ":47-51 and :124 (128 images x 2 members), preprocessing "
                    ":61-80, loss :83, steps :87, pre_logits 512 :113, capacity 1.5 "
                    ":141 (training and evaluation: the config sets no "
                    "evaluation override), optimizer :154-165. The E3 paper's "
                    "App. A.3 evaluates at capacity 8, but for its 384 px "
                    "protocol (batch 512, expert dropout 0.1), not this 128 px "
                    "config whose 81.31% was measured at 1.5"),
            reproduces=("E3 S/32 (K=1, M=2) CIFAR-100, config docstring :21: 81.31% "
                        "test"),
            optimizer="sgd", learning_rate=0.005, end_learning_rate=1e-5,
            schedule="warmup_cosine_decay", warmup_steps=200, train_steps=2_000,
            batch_size=1024, clip_global_norm=10.0, momentum=0.9,
            loss="ensemble_softmax_xent",
            train_capacity_factor=1.5, eval_capacity_factor=1.5, images_per_group=128,
            representation_size=512, image_size=128,
            train_preprocessing="decode|inception_crop(128)|flip_lr",
            eval_preprocessing="resize", dataset="cifar100 train[:98%] / test",
        ),
        Recipe(
            name="soft_moe_ft",
            source=("No upstream Soft MoE fine-tuning config exists (Soft MoE paper "
                    "§3: 384 px ImageNet fine-tune, recipe not given); this is "
                    f"the V-MoE/ViT ImageNet fine-tune protocol of {UPSTREAM} "
                    f"{_FT}vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.py "
                    ":34-36, :85, :107-118 with Soft MoE routing (one image per "
                    "group, soft_moe/configs/common.py)"),
            reproduces=("Soft MoE paper Table 1 'INet finetune' column (protocol "
                        "only; their exact fine-tune hyper-parameters are unpublished)"),
            optimizer="sgd", learning_rate=0.003, end_learning_rate=1e-5,
            schedule="warmup_cosine_decay", warmup_steps=500, train_steps=10_000,
            batch_size=1024, clip_global_norm=10.0, momentum=0.9,
            train_capacity_factor=None, eval_capacity_factor=None, images_per_group=1,
            representation_size=None, image_size=384,
            train_preprocessing="decode_jpeg_and_inception_crop(384)|flip_lr",
            eval_preprocessing="resize", dataset="imagenet2012 train[:99%] / validation",
        ),
        Recipe(
            name="digits",
            source=("keras_vmoe's offline default (`keras-vmoe finetune` with no "
                    "arguments, cli/finetune.py DIGITS_DEFAULTS: 100 epochs of "
                    "1,437 images at batch 64, learning rate 0.1, 5% warm-up, "
                    "MixUp 0.2; the small V-MoE with dropout 0.1), SGD momentum "
                    "0.9 as optax trace, cosine to zero, label smoothing 0.1. "
                    "Clip 1.0 is keras_vmoe's choice for this small model "
                    "trained from scratch, NOT upstream's (10.0); the end at "
                    "zero, the label smoothing, MixUp and dropout make the "
                    "result robust to seeds and to float32 rounding "
                    "(docs/guides/finetuning.md)"),
            reproduces=("no paper number: the offline main job (every seed 0-4 "
                        ">= 97% test accuracy; CI's landing guard)"),
            optimizer="sgd", learning_rate=0.1, end_learning_rate=0.0,
            schedule="warmup_cosine_decay", warmup_steps=110, train_steps=100 * 22,
            batch_size=64, clip_global_norm=1.0, momentum=0.9, label_smoothing=0.1,
            mixup=0.2,
            # No upstream grouping to reproduce: the model keeps its groups
            # (the command line's model routes each batch as one group).
            train_capacity_factor=None, eval_capacity_factor=None, images_per_group=None,
            representation_size=None, image_size=32,
            train_preprocessing="inception_crop(32, area 60-100%)|mixup(0.2)",
            eval_preprocessing="resize", dataset="digits train / test",
        ),
        Recipe(
            name="vmoe_pretrain_imagenet21k",
            source=("google-research/vmoe@942a78b vmoe/configs/vmoe_paper/pretrain_"
                    "imagenet21k.py: preprocessing :49-62, batch :53, loss "
                    "sigmoid_xent :68, model B/16 :70, mixup 0.5 :74-76, group of "
                    "8 images :125-127, capacity 1.05 :166, Adam :186-191 (weight "
                    "decay 0.1 on kernels), schedule :194-205, clip 1.0 :207-208"),
            reproduces=("V-MoE paper Table 6 pre-training setup (B/16 on ImageNet-21k, "
                        "the checkpoint fine-tuned by vmoe_ft_cifar10)"),
            optimizer="adam", learning_rate=8e-4, end_learning_rate=1e-5,
            schedule="warmup_linear_decay", warmup_steps=10_000,
            # 300 epochs (:73); ~13M images in full[102400:] (the size is
            # not in the config: the step count is approximate).
            train_epochs=300, train_steps=300 * 13_000_000 // 4096, batch_size=4096,
            clip_global_norm=1.0, adam_b1=0.9, adam_b2=0.999, weight_decay=0.1,
            loss="sigmoid_xent",
            train_capacity_factor=1.05, eval_capacity_factor=1.05, images_per_group=8,
            representation_size=None, image_size=224,
            train_preprocessing="decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2,20)",
            eval_preprocessing="resize_small_central_crop", randaugment=(2, 20),
            mixup=0.5, dataset="imagenet21k full[102400:] / full[:102400]",
        ),
        Recipe(
            name="vmoe_pretrain_ilsvrc2012_light1",
            source=(f"{UPSTREAM} {_FT}vmoe_s32_last2_ilsvrc2012_randaug_light1.py: "
                    "batch :49, loss sigmoid_xent :76, mixup light1 :83 (0.2, "
                    "common.py:111), eval capacity 4.0 :90-91, preprocessing "
                    ":99-100, :113, Adam weight decay/lr/clip :126-130 over "
                    "common.py:136-169, expert dropout 0.2 :137; 300 epochs"),
            reproduces=("released vmoe_s32_last2_ilsvrc2012_randaug_light1 (val 76.8 "
                        "/ test 73.1 / ReaL 74.4 / v2 59.2)"),
            optimizer="adam", learning_rate=3e-3, end_learning_rate=1e-5,
            schedule="warmup_linear_decay", warmup_steps=10_000,
            # 300 epochs (:78, :81) of train[:99%] (1,281,167 images).
            train_epochs=300, train_steps=math.ceil(300 * 1_268_355 / 8192),
            batch_size=8192,
            clip_global_norm=1.0, adam_b1=0.9, adam_b2=0.999, weight_decay=0.1,
            loss="sigmoid_xent",
            train_capacity_factor=1.05, eval_capacity_factor=4.0, images_per_group=8,
            expert_dropout=0.2, representation_size=512, image_size=224,
            train_preprocessing="decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2,10)",
            eval_preprocessing="resize_small_central_crop", randaugment=(2, 10),
            mixup=0.2, dataset="imagenet2012 train[:99%] / validation",
        ),
    )
}

def with_learning_rate(recipe, learning_rate):
    """`recipe` with its peak learning rate replaced (`None`: unchanged); the
    end rate is kept unless it would exceed the new peak."""
    if learning_rate is None:
        return recipe
    learning_rate = check_number(learning_rate, "learning_rate", inclusive=False)
    return dataclasses.replace(
        recipe, learning_rate=learning_rate,
        end_learning_rate=min(recipe.end_learning_rate, learning_rate))


def get_recipe(name):
    """The named `Recipe` (a `Recipe` is returned as is).

    Args:
        name: one of `RECIPES` (e.g. `"vmoe_ft_imagenet"`).

    Returns:
        A `Recipe`.

    Examples:

    ```python
    import keras_vmoe

    recipe = keras_vmoe.training.get_recipe("vmoe_ft_cifar10")
    print(recipe.learning_rate, recipe.clip_global_norm)   # 0.0015 10.0
    ```
    """
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise TypeError(
            "A recipe must be a `keras_vmoe.training.Recipe` or the name of one "
            f"({sorted(RECIPES)}); build a changed one with "
            "`dataclasses.replace(get_recipe(name), field=value)`. Received: "
            f"{type(name).__name__}")
    if name not in RECIPES:
        raise ValueError(
            f"Unknown recipe {name!r}. Valid recipes: {sorted(RECIPES)}.")
    return RECIPES[name]


def build_schedule(recipe, total_steps=None, warmup_steps=None):
    """The recipe's learning-rate schedule over `total_steps`.

    Args:
        recipe: a `Recipe` or its name.
        total_steps: int (default: `recipe.train_steps`).
        warmup_steps: int (default: the recipe's warm-up, scaled by
            `total_steps / recipe.train_steps`).

    Returns:
        A `keras.optimizers.schedules.LearningRateSchedule`.
    """
    recipe = get_recipe(recipe)
    total_steps = recipe.train_steps if total_steps is None else total_steps
    if warmup_steps is None:
        warmup_steps = round(recipe.warmup_steps * total_steps / recipe.train_steps)
        warmup_steps = min(warmup_steps, total_steps - 1)
    cls = {"warmup_cosine_decay": WarmupCosineDecay,
           "warmup_linear_decay": WarmupLinearDecay}[recipe.schedule]
    return cls(recipe.learning_rate, total_steps, warmup_steps,
               end_learning_rate=recipe.end_learning_rate)


def build_optimizer(recipe, total_steps=None, warmup_steps=None, **overrides):
    """The recipe's optimizer (with its schedule and gradient clip).

    Args:
        recipe: a `Recipe` or its name.
        total_steps: int (default: `recipe.train_steps`).
        warmup_steps: int, see `build_schedule`.
        **overrides: `Recipe` fields to replace (e.g. `learning_rate=0.01`).

    Returns:
        `UpstreamSGD` or `UpstreamAdam`.
    """
    recipe = dataclasses.replace(get_recipe(recipe), **overrides)
    schedule = build_schedule(recipe, total_steps, warmup_steps)
    if recipe.optimizer == "sgd":
        return UpstreamSGD(schedule, momentum=recipe.momentum,
                           global_clipnorm=recipe.clip_global_norm)
    return UpstreamAdam(
        schedule, beta_1=recipe.adam_b1, beta_2=recipe.adam_b2, epsilon=1e-8,
        weight_decay=recipe.weight_decay or None,
        global_clipnorm=recipe.clip_global_norm)


def compile_model(model, recipe, total_steps=None, warmup_steps=None):
    """Compiles a task with a recipe's optimizer, loss and training routing.

    Sigmoid recipes (pre-training) take one-hot / multi-hot labels `(B, C)`;
    softmax recipes keep the task's default (sparse) loss and metrics.

    Args:
        model: an `ImageClassifier` or `EnsembleImageClassifier`.
        recipe: a `Recipe` or its name.
        total_steps: int (default: `recipe.train_steps`).
        warmup_steps: int, see `build_schedule`.

    Returns:
        The model.

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    model = keras_vmoe.models.ImageClassifier.from_preset(  # a tiny V-MoE
        "vmoe_s32", load_weights=False, image_size=32, patch_size=16, hidden_dim=32,
        num_heads=2, mlp_dim=64, num_layers=4, num_experts=4, num_classes=5)
    keras_vmoe.training.compile_model(model, "vmoe_pretrain_imagenet21k",
                                      total_steps=20)
    images = np.random.default_rng(0).uniform(-1, 1, (8, 32, 32, 3))
    multi_hot = np.eye(5)[np.arange(8) % 5]          # (B, C) targets
    model.fit(images, multi_hot, epochs=1, verbose=0)
    ```
    """
    recipe = get_recipe(recipe)
    optimizer = build_optimizer(recipe, total_steps, warmup_steps)
    set_routing(model, recipe, training=True)
    if recipe.loss == "sigmoid_xent":
        model.compile(optimizer=optimizer,
                      loss=SigmoidCrossentropy(label_smoothing=recipe.label_smoothing),
                      metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")])
    else:
        compile_classifier(model, optimizer, label_smoothing=recipe.label_smoothing)
    return model


def compile_classifier(model, optimizer, dense_labels=False, label_smoothing=0.0):
    """Compiles a softmax classifier for class ids or one-hot labels.

    Class ids without smoothing keep the task's defaults; otherwise
    `SmoothedCrossentropy`, `CategoricalCrossentropy` or (E³)
    `EnsembleCrossentropy`, each with the matching accuracy.

    Args:
        model: an `ImageClassifier` or `EnsembleImageClassifier`.
        optimizer: a Keras optimizer.
        dense_labels: bool, the labels are one-hot or soft `(B, C)` (MixUp).
        label_smoothing: float in [0, 1).
    """
    label_smoothing = check_number(label_smoothing, "label_smoothing", 0.0)
    sparse = not dense_labels
    if sparse and not label_smoothing:
        model.compile(optimizer=optimizer)  # the task's sparse defaults
        return
    if isinstance(model, EnsembleImageClassifier):
        model.compile(optimizer=optimizer,
                      loss=EnsembleCrossentropy(from_logits=True, sparse=sparse,
                                                label_smoothing=label_smoothing),
                      metrics=[EnsembleAccuracy(sparse=sparse)])
        return
    from_logits = getattr(model, "activation", None) in (None, "linear")
    if sparse:
        loss = SmoothedCrossentropy(label_smoothing, from_logits=from_logits)
        accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    else:
        loss = keras.losses.CategoricalCrossentropy(from_logits=from_logits,
                                                    label_smoothing=label_smoothing)
        accuracy = keras.metrics.CategoricalAccuracy(name="accuracy")
    model.compile(optimizer=optimizer, loss=loss, metrics=[accuracy])


@keras.saving.register_keras_serializable(package="keras_vmoe")
class SmoothedCrossentropy(keras.losses.Loss):
    """Softmax cross-entropy against smoothed targets, for ids or one-hot labels.

    The targets are `(1 - label_smoothing) * one_hot + label_smoothing / C`;
    unlike Keras' sparse loss, class ids can be smoothed. Computed in float32.

    Args:
        label_smoothing: float in [0, 1).
        from_logits: bool, `y_pred` are logits (else probabilities).
        sparse: bool, the labels are class ids (else one-hot or soft
            `(B, C)`).
        **kwargs: `keras.losses.Loss` arguments.

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    loss = keras_vmoe.training.SmoothedCrossentropy(0.1)
    print(float(loss(np.array([2, 0]), np.array([[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]]))))
    ```
    """

    def __init__(self, label_smoothing=0.1, from_logits=True, sparse=True,
                 name="smoothed_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = check_probability(label_smoothing, "label_smoothing",
                                                 include_one=False)
        self.from_logits = bool(from_logits)
        self.sparse = bool(sparse)

    def call(self, y_true, y_pred):
        y_pred = ops.cast(y_pred, "float32")
        num_classes = ops.shape(y_pred)[-1]
        if self.sparse:
            labels = ops.cast(ops.reshape(y_true, (-1,)), "int32")
            y_true = ops.one_hot(labels, num_classes, dtype="float32")  # (B, C)
        targets = (ops.cast(y_true, "float32") * (1.0 - self.label_smoothing)
                   + self.label_smoothing / num_classes)
        if self.from_logits:
            log_probs = ops.log_softmax(y_pred, axis=-1)
        else:
            log_probs = ops.log(ops.clip(y_pred, 1e-7, 1.0))
        return -ops.sum(targets * log_probs, axis=-1)  # (B,)

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing,
                "from_logits": self.from_logits, "sparse": self.sparse}


@keras.saving.register_keras_serializable(package="keras_vmoe")
class SigmoidCrossentropy(keras.losses.Loss):
    """Sum over classes of the sigmoid cross-entropy (upstream's `sigmoid_xent`).

    One-hot / multi-hot targets `(B, C)` and logits `(B, C)`.

    Args:
        label_smoothing: float.
        **kwargs: `keras.losses.Loss` arguments.
    """

    def __init__(self, label_smoothing=0.0, name="sigmoid_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        y_true = ops.cast(y_true, "float32")
        if self.label_smoothing:
            y_true = y_true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        logits = ops.cast(y_pred, "float32")
        # log(1 + exp(-|x|)) + max(x, 0) - x·y: stable binary cross-entropy.
        losses = (ops.relu(logits) - logits * y_true
                  + ops.log1p(ops.exp(-ops.abs(logits))))
        return ops.sum(losses, axis=-1)

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


def set_routing(model, recipe, training=True):
    """Sets a recipe's capacity factors, routing groups and expert dropout.

    The training and evaluation capacity are set separately (a recipe
    without `eval_capacity_factor` keeps the model's evaluation routing).
    Expert dropout needs a model built with some (`moe={"dropout_rate":
    ...}`). Everything is checked before anything changes; Soft MoE and
    dense models are returned unchanged.

    Args:
        model: a keras_vmoe task or backbone.
        recipe: a `Recipe` or its name.
        training: bool. `False`: only the evaluation routing and groups;
            the training routing and dropout stay.

    Returns:
        The model.

    Examples:

    ```python
    import keras_vmoe

    config = keras_vmoe.models.backbone_config(   # a tiny V-MoE
        "vmoe", "S/32", image_size=32, patch_size=16, hidden_dim=32,
        num_heads=2, mlp_dim=64, num_layers=2, layout="every2", num_experts=4,
        moe={"dropout_rate": 0.1})
    model = keras_vmoe.models.ImageClassifier(
        keras_vmoe.models.VisionTransformerBackbone(**config), num_classes=5)
    keras_vmoe.training.set_routing(model, "vmoe_pretrain_ilsvrc2012_light1")
    layer = model.backbone.get_moe_layers()[0]
    print(layer.capacity_factor, layer.eval_routing)  # 1.05 {'capacity_factor': 4.0}
    ```
    """
    recipe = get_recipe(recipe)
    backbone = getattr(model, "backbone", model)
    layers = backbone.get_moe_layers() if hasattr(backbone, "get_moe_layers") else []
    if not layers or backbone.moe_type == "soft":
        return model
    recipe.__post_init__()  # again: a frozen dataclass can still be changed
    factors = {phase: float(getattr(recipe, f"{phase}_capacity_factor"))
               for phase in ("train", "eval")
               if getattr(recipe, f"{phase}_capacity_factor") is not None
               and (training or phase == "eval")}
    group, rate = recipe.images_per_group, recipe.expert_dropout
    dropouts = []
    for layer in layers if training else []:
        dropout = getattr(getattr(layer, "experts", None), "dropout", None)
        if dropout is None or dropout.rate == rate:
            continue
        if not getattr(dropout, "seed_generator", None):
            # A rate-0 Dropout has no random state to draw masks from.
            raise ValueError(
                f"Recipe {recipe.name!r} trains with expert dropout {rate}, but "
                "the model's expert layers were built without dropout: build the "
                f"backbone with `moe={{..., 'dropout_rate': {rate}}}`.")
        dropouts.append((layer, dropout))
    if group is not None:
        backbone.set_routing(images_per_group=group,
                             phase="both" if training else "eval")
    if "train" in factors:
        # phase="train" pins the current evaluation capacity first.
        backbone.set_routing(capacity_factor=factors["train"], phase="train")
    if "eval" in factors:
        backbone.set_routing(capacity_factor=factors["eval"], phase="eval")
    for layer, dropout in dropouts:
        layer.dropout_rate = layer.experts.dropout_rate = dropout.rate = float(rate)
    return model
