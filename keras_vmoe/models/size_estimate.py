"""Size of a model from its config numbers alone (nothing built).

`check_backbone` and `check_serialized_model` refuse, before any layer exists,
a config that needs more memory than this machine has (a lower bound).
"""

from keras_vmoe.utils import memory_budget
from keras_vmoe.utils.validation import MAX_GROUP_CHOICES
from keras_vmoe.utils.validation import check_pair
from keras_vmoe.utils.validation import is_int

MAX_LAYERS = 1000
_FLOAT_BYTES = 4


def _int(value, default=0):
    if not is_int(value):
        return default
    return int(value)


def _pair(value, name):
    # (1, 1) for an invalid value: the backbone refuses it with its own message.
    try:
        return check_pair(value, name)
    except ValueError:
        return 1, 1


def backbone_sizes(config):
    """Lower bounds of `(parameters, largest activation of one image)` of a
    backbone config."""
    image_h, image_w = _pair(config.get("image_size", 224), "image_size")
    patch_h, patch_w = _pair(config.get("patch_size", 16), "patch_size")
    hidden = _int(config.get("hidden_dim", 768), 1)
    layers = _int(config.get("num_layers", 12), 1)
    heads = _int(config.get("num_heads", 12), 1)
    mlp = _int(config.get("mlp_dim", 3072), 1)
    channels = _int(config.get("num_channels", 3), 3)
    members = max(1, _int(config.get("ensemble_size", 1), 1))
    tokens = max(1, image_h // max(patch_h, 1)) * max(1, image_w // max(patch_w, 1)) + 1
    moe = config.get("moe") if isinstance(config.get("moe"), dict) else {}
    moe_layers = config.get("moe_layers") or ()
    num_moe = len(moe_layers) if isinstance(moe_layers, (list, tuple)) else 0
    num_moe = min(num_moe, layers)
    experts = max(1, _int(moe.get("num_experts", 1), 1))
    expert_mlp = _int(moe.get("mlp_dim"), mlp) or mlp
    slots = _int(moe.get("num_slots"), 0)
    params = (
        patch_h * patch_w * channels * hidden
        + tokens * hidden
        + layers * 4 * hidden * hidden
        + (layers - num_moe) * 2 * hidden * mlp
        + num_moe * experts * (2 * hidden * expert_mlp + hidden * max(slots, 1))
        + _int(config.get("representation_size"), 0) * hidden
    )
    member_tokens = tokens * members
    activations = max(
        member_tokens * max(mlp, hidden),
        heads * member_tokens * tokens,
        experts * slots * (hidden + tokens) if num_moe else 0,
    )
    return params, activations


def _value_bytes(dtype):
    """Bytes of one variable value under a dtype policy (name or config)."""
    if isinstance(dtype, dict):
        dtype = (dtype.get("config") or {}).get("name")
    dtype = getattr(dtype, "name", dtype)  # a DTypePolicy
    return 2 if dtype in ("bfloat16", "float16") else _FLOAT_BYTES


def check_backbone(config, check_memory=True):
    """Refuses a backbone config too large to build here: more than
    `MAX_LAYERS` blocks, routing groups whose choices exceed int32, or (with
    `check_memory`) more than the machine's memory (`MemoryBudgetError`)."""
    layers = _int(config.get("num_layers", 12), 0)
    if layers > MAX_LAYERS:
        raise ValueError(
            f"`num_layers` must be an integer between 1 and {MAX_LAYERS}. "
            f"Received: num_layers={layers}"
        )
    moe = config.get("moe") if isinstance(config.get("moe"), dict) else {}
    if check_memory:
        params, activations = backbone_sizes(config)
        settings = ", ".join(
            f"{key}={config[key]!r}"
            for key in ("image_size", "patch_size", "hidden_dim", "num_layers", "mlp_dim")
            if key in config
        )
        settings += "".join(
            f", moe[{key!r}]={moe[key]!r}"
            for key in ("num_experts", "mlp_dim", "hidden_dim", "num_slots")
            if moe.get(key) is not None
        )
        memory_budget.check_fits(
            (params + activations) * _value_bytes(config.get("dtype")),
            f"This model ({params} parameters, {activations} activation values per "
            "image)",
            settings,
        )
    for group_size, images_per_group, k in _config_groups(moe):
        check_routing_group(config, _int(group_size, None), _int(images_per_group, None),
                            k, check_memory=check_memory, where="moe")


in_abstract_build = memory_budget.in_abstract_build


def _tokens_per_image(config):
    """Tokens T of one image at the MoE layers (class token included)."""
    image_h, image_w = _pair(config.get("image_size", 224), "image_size")
    patch_h, patch_w = _pair(config.get("patch_size", 16), "patch_size")
    patches = max(1, image_h // max(patch_h, 1)) * max(1, image_w // max(patch_w, 1))
    return patches + int(config.get("classifier", "token") == "token")


def check_routing_group(config, group_size=None, images_per_group=None,
                        num_selected_experts=1, check_memory=True, where=""):
    """Refuses a routing group (every call computes a whole one) whose token
    choices exceed int32 (`ValueError`) or whose images exceed the machine's
    memory (`MemoryBudgetError`). `where="moe"` names the setting as a config
    entry (`moe['images_per_group']`)."""
    if group_size is None and images_per_group is None:
        return
    name = "images_per_group" if images_per_group is not None else "group_size"
    value = images_per_group if images_per_group is not None else group_size
    setting = f"{where}[{name!r}]={value!r}" if where else f"{name}={value!r}"
    tokens = _tokens_per_image(config) * max(1, _int(config.get("ensemble_size", 1), 1))
    per_image = f"{tokens} per image" + (
        " with its copies" if _int(config.get("ensemble_size", 1), 1) > 1 else "")
    group_tokens = group_size if images_per_group is None else images_per_group * tokens
    images = images_per_group if images_per_group is not None else -(-group_size // tokens)
    k = max(1, _int(num_selected_experts, 1))
    if group_tokens * k > MAX_GROUP_CHOICES:
        most = MAX_GROUP_CHOICES // k // (tokens if images_per_group is not None else 1)
        raise ValueError(
            f"`{setting}` makes routing groups of {group_tokens} tokens ({per_image}) "
            f"of num_selected_experts={k} choices each, more choices than the "
            f"routing's int32 indices count ({MAX_GROUP_CHOICES}): `{name}` must be "
            f"at most {most} for this model. "
            "A partial group is padded to a whole one, so a group is computed whole "
            "even for one image."
        )
    if not check_memory:
        return
    image_h, image_w = _pair(config.get("image_size", 224), "image_size")
    image_values = image_h * image_w * max(1, _int(config.get("num_channels", 3), 3))
    _, activations = backbone_sizes(config)
    memory_budget.check_fits(
        images * (image_values + activations) * _value_bytes(config.get("dtype")),
        f"A routing group of {images} images (a partial group is padded to a whole "
        "one, so every call computes one)",
        setting,
    )


def _config_groups(moe):
    """`(group_size, images_per_group, K)` of a `moe` config's two phases."""
    router = moe.get("router") if isinstance(moe.get("router"), dict) else {}
    train = (moe.get("group_size"), moe.get("images_per_group"),
             router.get("num_selected_experts"))
    evaluation = moe.get("eval_routing") if isinstance(moe.get("eval_routing"), dict) else {}
    k = evaluation.get("num_selected_experts", train[2])
    if "group_size" in evaluation or "images_per_group" in evaluation:
        return [train, (evaluation.get("group_size"), evaluation.get("images_per_group"), k)]
    return [train, (train[0], train[1], k)]


def check_head(input_dim, num_classes, check_memory=True):
    """Refuses a classification head of `input_dim x num_classes` too large."""
    if not check_memory:
        return
    memory_budget.check_fits(
        _int(input_dim, 0) * _int(num_classes, 0) * _FLOAT_BYTES,
        f"The classification head ({input_dim} x {num_classes} weights)",
        f"num_classes={num_classes!r}",
    )


def check_serialized_model(config):
    """`check_backbone` and `check_head` of a serialized task or backbone
    (e.g. a preset's `config.json`); other shapes are ignored."""
    inner = config.get("config") if isinstance(config, dict) else None
    if not isinstance(inner, dict):
        return
    backbone = inner.get("backbone")
    if isinstance(backbone, dict) and isinstance(backbone.get("config"), dict):
        backbone_config = backbone["config"]
    else:
        backbone_config = inner
    check_backbone(backbone_config)
    num_classes = _int(inner.get("num_classes"), 0)
    if num_classes:
        width = _int(backbone_config.get("representation_size"), 0) or _int(
            backbone_config.get("hidden_dim", 768), 1
        )
        params, activations = backbone_sizes(backbone_config)
        memory_budget.check_fits(
            (params + activations + width * num_classes)
            * _value_bytes(backbone_config.get("dtype")),
            f"This model with its head ({width} x {num_classes} weights)",
            f"num_classes={num_classes!r}",
        )

