"""Converts upstream google-research/vmoe (and ViT) checkpoints to keras_vmoe.

Sources: vmoe partitioned checkpoints, vit_jax `.npz` files, trainer
checkpoints and `{path: array}` dicts. The architecture comes from the
shapes (`infer`), the routing from the preset catalog and/or arguments.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from keras_vmoe import catalog
from keras_vmoe.conversion.infer import RoutingSettings
from keras_vmoe.conversion.infer import infer_architecture
from keras_vmoe.conversion.infer import upstream_backbone_config
from keras_vmoe.conversion.weights import assign_weights
from keras_vmoe.conversion.weights import conversion_plan
from keras_vmoe.formats.upstream import iter_upstream_params
from keras_vmoe.formats.upstream import read_upstream_shapes
from keras_vmoe.formats.upstream import resolve_upstream
from keras_vmoe.formats.upstream import strip_index_suffix
from keras_vmoe.utils.validation import patch_grid

__all__ = ["build_model_from_upstream", "preset_for_upstream", "routing_from_preset"]

logger = logging.getLogger(__name__)


def _catalog_entry(name: str) -> Mapping[str, Any]:
    presets, aliases = catalog.PRESETS, catalog.ALIASES
    resolved = aliases.get(name, name)
    if resolved not in presets:
        raise ValueError(
            f"Unknown preset {name!r}. Known presets with upstream weights: "
            f"{sorted(n for n, p in presets.items() if p.get('weights'))}"
        )
    return presets[resolved]


def preset_for_upstream(upstream: str) -> str | None:
    """The catalog preset whose released weights are `upstream` (or None)."""
    upstream = strip_index_suffix(os.fspath(upstream)).rstrip("/")
    base = posixpath.basename(upstream)
    by_base = None
    for name, entry in catalog.PRESETS.items():
        source = (entry.get("weights") or {}).get("upstream")
        if not source:
            continue
        if source.rstrip("/") == upstream:
            return name
        if posixpath.basename(source.rstrip("/")) == base or name == base:
            by_base = name
    return by_base


def routing_from_preset(name: str) -> RoutingSettings:
    """Routing settings of a catalog preset (`keras_vmoe.catalog`).

    Args:
        name: the preset name (or alias).

    Returns:
        A `RoutingSettings`.
    """
    entry = _catalog_entry(name)
    routing = dict(entry.get("routing") or {})
    family = entry.get("family")
    settings: dict[str, Any] = {}
    if family in ("vmoe", "vmoe_15b", "eee"):
        router = routing.pop("router", None) or routing.pop("name", None) or "token_choice"
        settings["router"] = {"softmax_token_choice": "token_choice",
                              "softmax_expert_choice": "expert_choice"}.get(router, router)
        settings["bfloat16_dispatch"] = routing.pop("bfloat16_dispatch", True)
        for key in RoutingSettings.fields():
            if key in routing and routing[key] is not None:
                settings[key] = routing[key]
        if routing.get("group_size", "unset") is None:
            settings["group_size"] = "all"
        if entry.get("eval_routing"):
            settings["eval_routing"] = dict(entry["eval_routing"])
    elif family == "soft_moe":
        settings["bfloat16_dispatch"] = routing.get("bfloat16_dispatch", True)
    return RoutingSettings().merged(**settings)


def routing_from_upstream_config(model_config: Mapping[str, Any],
                                 image_size: int) -> dict[str, Any]:
    """Converter routing arguments equal to an upstream model config.

    The group size (tokens) is returned as whole `images_per_group`.

    Args:
        model_config: upstream `config.model` as a dict (`encoder.moe`,
            `patch_size`, `classifier`, ...).
        image_size: int, the resolution the config is used at.

    Returns:
        A dict of keyword arguments for `build_model_from_upstream` and
        `convert_to_preset` (empty for Soft MoE, whose routing is fixed).

    Raises:
        ValueError: the group size is not a whole number of images.

    Examples:

    ```python
    from keras_vmoe.conversion import routing_from_upstream_config

    config = {"patch_size": (16, 16), "classifier": "token", "encoder": {"moe": {
        "group_size": 8 * 197, "router": {
            "num_selected_experts": 2, "noise_std": 1.0,
            "dispatcher": {"capacity_factor": 1.05, "bfloat16": True}}}}}
    routing = routing_from_upstream_config(config, image_size=224)
    assert routing["images_per_group"] == 8 and routing["router"] == "token_choice"
    ```
    """
    moe = model_config["encoder"]["moe"]
    router = moe.get("router", {})
    name = router.get("name", "NoisyTopExpertsPerItemRouter")
    if name.endswith("SoftRouter"):
        return {}
    dispatcher = router["dispatcher"]
    grid = patch_grid(image_size, model_config["patch_size"])
    tokens = (grid[0] * grid[1] + int(model_config.get("classifier") == "token")) \
        * moe.get("ensemble_size", 1)
    if moe["group_size"] % tokens:
        raise ValueError(
            f"The upstream group_size={moe['group_size']} is not a whole number of "
            f"images of {tokens} tokens at image_size={image_size} "
            f"(patch {model_config['patch_size'][0]}); "
            "pass the image size the config was used at.")
    routing = {
        "capacity_factor": dispatcher["capacity_factor"],
        "images_per_group": moe["group_size"] // tokens,
        "bfloat16_dispatch": dispatcher["bfloat16"],
    }
    for key in ("capacity_ceil_or_round", "capacity_multiple_of"):
        if key in dispatcher:
            routing[key] = dispatcher[key]
    if name == "NoisyTopItemsPerExpertRouter":
        routing["router"] = "expert_choice"
    else:
        routing.update(router="token_choice",
                       num_selected_experts=router["num_selected_experts"],
                       batch_priority=dispatcher.get("batch_priority", False))
    return routing


def _preset_defaults(name: str) -> dict[str, Any]:
    """Non-routing conversion defaults of a catalog preset."""
    entry = _catalog_entry(name)
    task = entry.get("task") or {}
    out = {}
    if "head_bias_init" in task:
        out["head_bias_init"] = task["head_bias_init"]
    if entry.get("image_size"):
        out["image_size"] = entry["image_size"]
    ensemble_size = (entry.get("overrides") or {}).get("ensemble_size")
    if ensemble_size and ensemble_size > 1:
        out["ensemble_size"] = ensemble_size
    return out


_ROUTING_KEYS = set(RoutingSettings.fields())


def build_model_from_upstream(
    params,
    *,
    preset: str | None = None,
    routing: RoutingSettings | Mapping[str, Any] | None = None,
    image_size: int | tuple[int, int] | None = None,
    position_embedding: str | None = None,
    ensemble_size: int | None = None,
    include_head: bool = True,
    head_bias_init: float | None = None,
    dtype: str | None = None,
    step: int | None = None,
    **routing_overrides,
):
    """Builds the keras_vmoe model of an upstream checkpoint and loads its weights.

    Args:
        params: a flat `{upstream_path: array}` dict, a partitioned
            checkpoint prefix (local or gs://), a trainer checkpoint (Orbax
            directory or `ckpt_<step>` prefix), a `ResolvedCheckpoint` or a
            `.npz` path.
        preset: catalog preset name whose routing (and head bias) to use.
        routing: `RoutingSettings` (or a dict) to start from instead of the
            preset's.
        image_size: resolution of the Keras model (default: the
            checkpoint's); another size resizes the position embedding.
        position_embedding: for checkpoints without a learned one:
            "sincos2d" (default) or "none".
        ensemble_size: E³ members when the router kernel is stored 2-D.
        include_head: False returns the backbone only.
        head_bias_init: recorded in the task config (the weights are loaded).
        dtype: dtype policy of the model (default float32).
        step: training step of a trainer checkpoint (default: the latest).
        **routing_overrides: any `RoutingSettings` field; they take
            precedence over `preset` and `routing`.

    Returns:
        An `ImageClassifier` (`EnsembleImageClassifier` for E³) if the
        checkpoint has a `head` and `include_head`, else the backbone.

    Raises:
        ConversionError: the checkpoint is not a supported model, or its
            arrays and the model's weights do not match (listed).
        keras_vmoe.formats.CheckpointError: unreadable checkpoint files.
    """
    unknown = sorted(set(routing_overrides) - _ROUTING_KEYS)
    if unknown:
        raise TypeError(
            f"Unknown arguments {unknown}. Routing settings are "
            f"{sorted(_ROUTING_KEYS)}."
        )
    params = resolve_upstream(params, step)
    settings = RoutingSettings()
    defaults: dict[str, Any] = {}
    if preset is not None:
        settings = routing_from_preset(preset)
        defaults = _preset_defaults(preset)
        if head_bias_init is None:
            head_bias_init = defaults.get("head_bias_init")
        if ensemble_size is None:
            ensemble_size = defaults.get("ensemble_size")
    if routing is not None:
        settings = (routing if isinstance(routing, RoutingSettings)
                    else settings.merged(**dict(routing)))
    settings = settings.merged(**routing_overrides)

    shapes = read_upstream_shapes(params)
    arch = infer_architecture(
        shapes, image_size=image_size, position_embedding=position_embedding,
        ensemble_size=ensemble_size,
    )
    expected_size = defaults.get("image_size")
    if image_size is None and expected_size and arch.image_size != (
        (expected_size, expected_size) if isinstance(expected_size, int)
        else tuple(expected_size)
    ):
        logger.warning(
            "Preset %r is listed at %spx but the checkpoint's position embedding "
            "is for %s; building the model at the checkpoint's resolution.",
            preset, expected_size, arch.image_size,
        )
    config = upstream_backbone_config(arch, settings)
    from keras_vmoe.utils.initialization import (
        skip_initializers,  # lazy: conversion loads without Keras
    )

    with skip_initializers() as skipped:
        model = _build_keras_model(config, arch, include_head, head_bias_init, dtype)
        if not include_head:
            shapes = {k: v for k, v in shapes.items()
                      if not re.search(r"(^|/)head/(kernel|bias)$", k)}
        plan = conversion_plan(shapes, model, arch)
        leaves = iter_upstream_params(params)
        if not include_head:
            leaves = ((k, v) for k, v in leaves if k in plan)
        assign_weights(model, plan, arch, leaves)
    skipped.check_assigned(model, source="the upstream checkpoint")
    return model


def _build_keras_model(config, arch, include_head, head_bias_init, dtype):
    from keras_vmoe import models  # lazy: conversion loads without Keras

    if dtype is not None:
        config = dict(config, dtype=dtype)
    backbone = models.VisionTransformerBackbone(**config)
    if not include_head or not arch.num_classes:
        return backbone
    task_cls = (models.EnsembleImageClassifier if arch.ensemble_size > 1
                else models.ImageClassifier)
    return task_cls(
        backbone,
        num_classes=arch.num_classes,
        head_bias_init=0.0 if head_bias_init is None else float(head_bias_init),
    )
