"""Sparse upcycling: turn a dense ViT into a V-MoE, Soft MoE or E³ model.

Sparse upcycling (Komatsuzaki et al., 2022, https://arxiv.org/abs/2212.05055)
copies each chosen block's dense MLP into all experts, adds a fresh router and
copies every other weight, as upstream's `initialize_from_vit`. What the model
computes at step 0 is in the upcycling guide.
"""

import copy
import os

import keras
import numpy as np

from keras_vmoe.conversion.build import build_model_from_upstream
from keras_vmoe.layers.experts import seeded_copy
from keras_vmoe.models.configs import moe_layers_from_layout
from keras_vmoe.models.ensemble_classifier import EnsembleImageClassifier
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone
from keras_vmoe.presets import provenance
from keras_vmoe.presets.load import from_preset
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

MOE_TYPES = ("sparse", "soft", "ensemble")
# Experts of a block <- the block's dense MLP (Keras weight paths).
_EXPERT_SOURCES = {f"{kind}_{i}": f"mlp/dense_{i}/{kind}"
                   for i in (0, 1) for kind in ("kernel", "bias")}
# Default routing: the V-MoE paper's Token Choice (Table 8); E³: K=1, C=1.5.
_SPARSE_ROUTER = dict(name="token_choice", num_selected_experts=2,
                      capacity_factor=1.05, noise_std=1.0,
                      importance_loss_weight=0.005, load_loss_weight=0.005)
_ENSEMBLE_ROUTER = dict(_SPARSE_ROUTER, num_selected_experts=1, capacity_factor=1.5)
IMAGES_PER_GROUP = 8
_SOFTMAX_ROUTERS = ("token_choice", "softmax_token_choice", "renormalized_token_choice")


def _resolve_source(source, preset_overrides):
    """`(model, description)` of a source: model, preset or `.npz` path."""
    if isinstance(source, keras.Model):
        return source, {"kind": "model", "class_name": type(source).__name__,
                        "name": source.name}
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.endswith(".npz"):
            overrides = dict(preset_overrides or {})
            num_classes = overrides.pop("num_classes", None)
            model = build_model_from_upstream(text, **overrides)
            if num_classes is not None:  # a new zero-initialised head
                model = ImageClassifier(getattr(model, "backbone", model),
                                        num_classes=num_classes)
            return model, {"kind": "vit_npz", "path": text}
        return from_preset(text, **(preset_overrides or {})), {
            "kind": "preset", "preset": text}
    raise ValueError(
        "`source` must be a keras_vmoe ViT model (backbone or task), a preset "
        "name or directory, or a vit_jax `.npz` path. Received: "
        f"source={source!r:.100} of type {type(source).__name__}")


def _moe_layers(backbone, moe_layers, layout):
    if moe_layers is not None and layout is not None:
        raise ValueError(
            "Pass at most one of `moe_layers` and `layout`. Received: "
            f"moe_layers={moe_layers!r}, layout={layout!r}")
    if moe_layers is None:
        layers = moe_layers_from_layout(layout or "every2", backbone.num_layers)
    else:
        layers = tuple(sorted(check_int(i, "moe_layers", 0) for i in moe_layers))
    if not layers:
        raise ValueError(
            f"Upcycling needs at least one MoE block; layout={layout!r} / "
            f"moe_layers={moe_layers!r} selects none of the "
            f"{backbone.num_layers} blocks.")
    bad = [i for i in layers if i >= backbone.num_layers]
    if bad:
        raise ValueError(
            f"`moe_layers` {bad} out of range: the model has "
            f"{backbone.num_layers} blocks (valid 0..{backbone.num_layers - 1}).")
    already = [i for i in layers if i in backbone.moe_layers]
    if already:
        raise ValueError(
            f"Blocks {already} of the source are already MoE blocks; upcycling "
            "copies dense MLPs. Choose dense blocks (source moe_layers="
            f"{tuple(backbone.moe_layers)}).")
    return layers


def _moe_config(moe_type, num_experts, router, moe, renormalize_gates,
                ensemble_size, num_slots):
    if moe_type == "soft":
        if router:
            raise ValueError("Soft MoE layers have no `router` settings; use "
                             f"moe={{...}} (num_slots, ...). Received: router={router!r}")
        if renormalize_gates:
            raise ValueError("`renormalize_gates` applies to Token Choice "
                             "(moe_type='sparse') only.")
        config = {"type": "soft", "num_experts": num_experts,
                  "num_slots": num_slots, "bfloat16_dispatch": False}
    else:
        base = _ENSEMBLE_ROUTER if moe_type == "ensemble" else _SPARSE_ROUTER
        router_config = dict(base)
        if router:
            if not isinstance(router, dict):
                raise ValueError(f"`router` must be a dict of router settings. "
                                 f"Received: router={router!r}")
            name = router.get("name", base["name"])
            if name != base["name"]:  # another router kind: its own defaults
                router_config = {k: base[k] for k in ("noise_std", "capacity_factor")}
            router_config.update(router)
        if renormalize_gates:
            if moe_type == "ensemble":
                raise ValueError("`renormalize_gates` is not available for E³ "
                                 "(moe_type='ensemble').")
            if router_config.get("name", "token_choice") not in _SOFTMAX_ROUTERS:
                raise ValueError(
                    "`renormalize_gates` needs a softmax Token Choice router. "
                    f"Received: router name {router_config['name']!r}")
            router_config["name"] = "renormalized_token_choice"
        config = {"type": "sparse", "num_experts": num_experts,
                  "router": router_config, "images_per_group": IMAGES_PER_GROUP,
                  "bfloat16_dispatch": False}
        if moe_type == "ensemble" and num_experts % ensemble_size:
            raise ValueError(
                f"`num_experts` ({num_experts}) must be divisible by "
                f"`ensemble_size` ({ensemble_size}) for moe_type='ensemble'.")
    if moe:
        if not isinstance(moe, dict):
            raise ValueError(f"`moe` must be a dict. Received: moe={moe!r}")
        if "group_size" in moe or "images_per_group" in moe:
            config.pop("images_per_group", None)
        config.update(copy.deepcopy(moe))
    config.setdefault("identical_init", True)
    return config


def upcycle(source, num_experts=8, moe_layers=None, layout=None, router=None,
            moe_type="sparse", renormalize_gates=False, ensemble_size=2, num_slots=1,
            moe=None, seed=0, preset_overrides=None):
    """Sparse upcycling of a dense ViT into an MoE model.

    In every chosen block the dense MLP is copied into all `num_experts`
    experts and the router drawn fresh (block `i` with seed `seed + i`);
    every other weight is copied. The weights record of the result is
    `{"kind": "upcycled", "from": <the source's record>, ...}`.

    Args:
        source: a dense `VisionTransformerBackbone`, an `ImageClassifier`
            (its head is copied), a preset name or directory, or a vit_jax
            `.npz` path (read with `build_model_from_upstream`).
        num_experts: int E, experts per MoE block.
        moe_layers: 0-based block indices to upcycle. Exclusive with
            `layout`.
        layout: `"every2"` (default), `"last2"`, `"last5"`, `"last_half"`...
            (see `keras_vmoe.models.configs.moe_layers_from_layout`).
        router: dict merged into the default router, V-MoE's Token Choice
            (E³: K=1, capacity factor 1.5); another `"name"` (e.g.
            `"expert_choice"`) starts from that router's own defaults.
        moe_type: `"sparse"` (Token Choice / any sparse router), `"soft"`
            (Soft MoE) or `"ensemble"` (E³ with `ensemble_size` members).
        renormalize_gates: bool, Token Choice with the top-K gates divided
            by their sum: starts exactly at the dense function.
        ensemble_size: int N of `moe_type="ensemble"`.
        num_slots: int, slots per expert of `moe_type="soft"`.
        moe: dict merged into the backbone's `moe` config (e.g.
            `{"group_size": 64}`, `{"bfloat16_dispatch": True}`).
        seed: int, seed of the fresh routers.
        preset_overrides: dict of `from_preset` (or
            `build_model_from_upstream`) arguments for a preset or `.npz`.

    Returns:
        A `VisionTransformerBackbone` when the source is a backbone, else an
        `ImageClassifier` (`EnsembleImageClassifier` for
        `moe_type="ensemble"`) with the source's head.

    Examples:

    ```python
    import keras_vmoe

    dense = keras_vmoe.models.VisionTransformerBackbone(
        image_size=32, patch_size=8, hidden_dim=32, num_layers=4,
        num_heads=2, mlp_dim=64)
    moe = keras_vmoe.presets.upcycle(dense, num_experts=4, layout="last2")
    moe.moe_layers  # (1, 3)
    ```
    """
    check_one_of(moe_type, "moe_type", MOE_TYPES)
    num_experts = check_int(num_experts, "num_experts")
    seed = check_int(seed, "seed", 0)
    if moe_type == "ensemble":
        ensemble_size = check_int(ensemble_size, "ensemble_size", 2)
    if moe_type == "soft":
        num_slots = check_int(num_slots, "num_slots")
    model, origin = _resolve_source(source, preset_overrides)
    backbone = getattr(model, "backbone", model)
    if not isinstance(backbone, VisionTransformerBackbone):
        raise ValueError(
            "`source` must be a keras_vmoe ViT (a VisionTransformerBackbone or a "
            f"task wrapping one). Received: {type(model).__name__}")
    if backbone.ensemble_size > 1:
        raise ValueError("`source` is already an E³ ensemble; upcycle a dense ViT.")
    layers = _moe_layers(backbone, moe_layers, layout)
    moe_config = _moe_config(moe_type, num_experts, router, moe,
                             renormalize_gates, ensemble_size, num_slots)

    config = backbone.get_config()
    config["moe_layers"] = sorted(set(backbone.moe_layers) | set(layers))
    if backbone.moe_layers and backbone.moe != moe_config:
        raise ValueError(
            "The source already has MoE blocks with another `moe` config; all "
            "MoE blocks of a backbone share one config.")
    config["moe"] = moe_config
    if moe_type == "ensemble":
        config["ensemble_size"] = ensemble_size
    new_backbone = VisionTransformerBackbone.from_config(config)

    if model is not backbone:
        head = model.get_layer("head") if getattr(model, "num_classes", None) else None
        task_cls = EnsembleImageClassifier if moe_type == "ensemble" else ImageClassifier
        kwargs = dict(num_classes=model.num_classes, head_bias_init=model.head_bias_init,
                      head_dtype=getattr(model, "head_dtype", None), compile=False)
        if task_cls is ImageClassifier:
            kwargs["activation"] = getattr(model, "activation", None)
        result = task_cls(new_backbone, **kwargs)
        if head is not None:
            result.get_layer("head").set_weights(head.get_weights())
        if getattr(model, "class_names", None) is not None:
            result.class_names = list(model.class_names)
        result.compile()
    else:
        result = new_backbone
    _copy_weights(backbone, new_backbone, layers, seed)

    record = {"kind": "upcycled", "from": provenance.current(model), "source": origin,
              "num_experts": num_experts, "moe_layers": list(layers),
              "moe_type": moe_type, "router_seed": seed}
    provenance.record(result, record)
    object.__setattr__(result, "_keras_vmoe_upcycled", record)
    return result


def _copy_weights(source, target, layers, seed):
    """Copies every weight, tiles MLPs into experts and draws fresh routers."""
    source_values = {v.path: v for v in source.weights}
    upcycled = {f"encoderblock_{i}" for i in layers}
    for variable in target.weights:
        path = variable.path
        block, _, rest = path.partition("/")
        if block in upcycled and rest.startswith("moe/"):
            leaf = rest[len("moe/"):]
            if leaf.startswith("experts/"):
                name = leaf[len("experts/"):]
                value = keras.ops.convert_to_numpy(
                    source_values[f"{block}/{_EXPERT_SOURCES[name]}"].value)
                value = np.broadcast_to(value[None], tuple(variable.shape))
                variable.assign(value)
            continue  # routers: re-drawn below
        if path not in source_values:
            raise ValueError(f"The source model has no weight `{path}`.")
        value = source_values[path]
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"Shape mismatch for `{path}`: source "
                             f"{tuple(value.shape)}, upcycled {tuple(variable.shape)}.")
        # A copy: the two models must not share (donatable) device buffers.
        variable.assign(keras.ops.convert_to_numpy(value.value))
    for index in layers:
        router = target.get_layer(f"encoderblock_{index}").moe_layer.router
        for weight in router.weights:
            if weight.name == "scale":  # Soft MoE's scalar: its init (ones)
                weight.assign(np.ones(tuple(weight.shape), "float32"))
                continue
            init = seeded_copy(router.kernel_initializer, seed + index)
            weight.assign(init(tuple(weight.shape), dtype=weight.dtype))
