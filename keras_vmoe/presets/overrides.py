"""Overrides applied when loading a preset: routing, task and architecture.

Routing settings (`capacity_factor`, `group_size`, ...) are set on the
built model; `num_classes` makes a new head, `image_size` resizes the
position embedding, `representation_size=None` drops `pre_logits`.
"""


from keras_vmoe import models
from keras_vmoe.deploy.quantize import layers_by_path
from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.models import quantized_config
from keras_vmoe.models.configs import ROUTING_OVERRIDES
from keras_vmoe.models.configs import constructor_arguments
from keras_vmoe.models.quantized_config import quantize_found_layers
from keras_vmoe.presets import provenance
from keras_vmoe.presets.save import _to_jsonable
from keras_vmoe.utils.initialization import skip_initializers
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_pair
from keras_vmoe.utils.validation import is_int
from keras_vmoe.utils.validation import patch_grid

# Settings of the built model that keep every weight (`dtype`, `remat`, `scan`).
TASK_OVERRIDES = ("num_classes", "head_bias_init", "image_size", "dtype", "remat",
                  "scan")


def _split_overrides(overrides):
    routing = {k: overrides.pop(k) for k in ROUTING_OVERRIDES if k in overrides}
    if routing.get("capacity_factor") is not None:  # before any download/build
        routing["capacity_factor"] = validate_capacity_factor(routing["capacity_factor"])
    eval_routing = routing.get("eval_routing")
    if eval_routing is not None:
        if not isinstance(eval_routing, dict):
            raise ValueError(
                "`eval_routing` must be a dict of routing settings for evaluation, "
                f"e.g. {{'capacity_factor': 4.0}}. Received: eval_routing={eval_routing!r}"
            )
        unknown = sorted(set(eval_routing) - set(ROUTING_OVERRIDES[:-1]))
        if unknown:
            raise ValueError(
                f"Unknown `eval_routing` settings {unknown}. Valid: "
                f"{list(ROUTING_OVERRIDES[:-1])}.")
        if eval_routing.get("capacity_factor") is not None:
            validate_capacity_factor(
                eval_routing["capacity_factor"], name="eval_routing['capacity_factor']")
    task = {k: overrides.pop(k) for k in TASK_OVERRIDES if k in overrides}
    for key in ("remat", "scan"):
        if key in task:
            task[key] = check_bool(task[key], key)
    return routing, task, overrides  # the rest: architecture overrides


def _set_backbone_option(config, key, value):
    """Sets `key` in the backbone config inside a serialized model config."""
    inner = config.get("config", {})
    if isinstance(inner.get("backbone"), dict):
        inner["backbone"].setdefault("config", {})[key] = value
    else:
        inner[key] = value


def _backbone_arguments():
    return constructor_arguments() - {"dtype", "remat", "scan"}


def _with_image_size(model, image_size):
    """Rebuilds `model` at a new resolution; position embeddings are resized."""
    backbone = getattr(model, "backbone", model)
    if not isinstance(backbone, models.VisionTransformerBackbone):
        raise ValueError(
            "The image_size override needs a VisionTransformerBackbone model. "
            f"Received a {type(backbone).__name__}.")
    if check_pair(backbone.image_size, "image_size") == check_pair(image_size, "image_size"):
        return model
    config = backbone.get_config()
    config["image_size"] = image_size
    grid = patch_grid(image_size, backbone.patch_size, require_multiple=True)
    moe = config.get("moe")
    group_size = (moe or {}).get("group_size")
    old_tokens = backbone.num_tokens
    if group_size and group_size % old_tokens == 0:
        # A group of whole images keeps its number of images.
        new_tokens = grid[0] * grid[1] + int(backbone.classifier == "token")
        config["moe"] = {**moe, "group_size": group_size // old_tokens * new_tokens}
    new_backbone = _backbone_copy(backbone, config)
    return new_backbone if model is backbone else task_copy(model, new_backbone)


def task_copy(model, backbone):
    """A copy of the task `model` on `backbone`, its head's weights copied (none drawn)."""
    with skip_initializers() as skipped:
        new_model = type(model)(**task_arguments(model, backbone))
        _quantize_like(model, new_model)
        _copy_head_weights(model, new_model)
    skipped.check_assigned(new_model, source="the loaded model")
    new_model.class_names = getattr(model, "class_names", None)
    return new_model


def task_arguments(model, backbone):
    """The float constructor arguments of a copy of the task `model` on `backbone`."""
    config = model.get_config()
    quantized_config.pop_quantized_layers(config)
    config["backbone"] = backbone
    return config


def _backbone_copy(backbone, config):
    """A backbone built from `config` holding all of `backbone`'s weights."""
    with skip_initializers() as skipped:
        new_backbone = models.VisionTransformerBackbone.from_config(config)
        _quantize_like(backbone, new_backbone)
        new_backbone.load_weights_from(backbone)
    skipped.check_assigned(new_backbone, source="the loaded backbone")
    return new_backbone


def _quantize_like(source, target):
    """Quantizes the layers of `target` quantized in `source` (those it has)."""
    found = layers_by_path(target)
    modes = {found[path]: mode
             for path, mode in quantized_layers(source).items() if path in found}
    return quantize_found_layers(target, modes)


def _head_weights(model):
    backbone_ids = {id(v) for v in model.backbone.weights}
    return [v for v in model.weights if id(v) not in backbone_ids]


def _copy_head_weights(source, target):
    src, dst = _head_weights(source), _head_weights(target)
    if len(src) != len(dst):
        raise ValueError(
            f"Cannot copy the head: {len(src)} source weights, {len(dst)} target weights."
        )
    for s, d in zip(src, dst, strict=True):
        if tuple(s.shape) != tuple(d.shape):
            raise ValueError(
                f"Head weight shape mismatch: {s.path} {tuple(s.shape)} vs "
                f"{d.path} {tuple(d.shape)}.")
        d.assign(s.value)


def new_head_bias_init(task_overrides):
    """Bias of a new head: `head_bias_init` if given, else `-log(num_classes)`
    (upstream's fine-tuning, whatever the pre-training head used)."""
    import math

    if task_overrides.get("head_bias_init") is not None:
        return task_overrides["head_bias_init"]
    num_classes = task_overrides["num_classes"]
    if not is_int(num_classes) or num_classes < 1:
        return 0.0  # the task rejects it with its own message
    return -math.log(num_classes)


def _with_num_classes(model, num_classes, head_bias_init):
    """The model's backbone with a new zero-kernel head of `num_classes` outputs."""
    import keras

    if not isinstance(model, models.Task):
        task_class = (models.EnsembleImageClassifier
                      if getattr(model, "ensemble_size", 1) > 1 else models.ImageClassifier)
        return task_class(model, num_classes=num_classes, head_bias_init=head_bias_init)
    config = task_arguments(model, model.backbone)  # the new head starts in float
    config.update(
        num_classes=num_classes, head_bias_init=head_bias_init,
        preprocessor=keras.layers.deserialize(keras.layers.serialize(model.preprocessor)))
    return type(model).from_config(config)


def _without_pre_logits(model):
    """Rebuilds `model`'s backbone without `pre_logits`, as upstream's fine-tuning."""
    backbone = getattr(model, "backbone", model)
    if not isinstance(backbone, models.VisionTransformerBackbone):
        raise ValueError(
            "The representation_size=None override needs a VisionTransformerBackbone "
            f"model. Received a {type(backbone).__name__}.")
    if not backbone.representation_size:
        return model
    config = backbone.get_config()
    config["representation_size"] = None
    new_backbone = _backbone_copy(backbone, config)
    if model is backbone:
        return new_backbone
    return type(model)(**task_arguments(model, new_backbone))


def _apply_overrides(model, routing, task_overrides, rebuild_head):
    if rebuild_head and "representation_size" in task_overrides:
        if "num_classes" not in task_overrides:
            raise ValueError(
                "representation_size=None drops the pre-logits layer the head "
                "was trained on: pass `num_classes` too for a new head (as "
                "upstream's fine-tuning configs do).")
        model = _without_pre_logits(model)
    if rebuild_head and "head_bias_init" in task_overrides and (
            "num_classes" not in task_overrides):
        raise ValueError(
            "`head_bias_init` only applies to a new head: pass `num_classes` too. "
            f"Received: head_bias_init={task_overrides['head_bias_init']!r}")
    if task_overrides.get("image_size") is not None:
        model = _with_image_size(model, task_overrides["image_size"])
    if rebuild_head and "num_classes" in task_overrides:
        model = _with_num_classes(model, task_overrides["num_classes"],
                                  new_head_bias_init(task_overrides))
    if routing:
        target = getattr(model, "backbone", model)
        routing = dict(routing)
        eval_routing = routing.pop("eval_routing", None)
        if routing:
            target.set_routing(**routing)
        if eval_routing:
            target.set_routing(phase="eval", **eval_routing)
    return model


def _record_origin(model, name, overrides, weights):
    object.__setattr__(model, "_keras_vmoe_preset", name)
    object.__setattr__(model, "_keras_vmoe_overrides", _to_jsonable(overrides))
    provenance.record(model, _to_jsonable(weights))
