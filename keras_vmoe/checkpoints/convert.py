"""Converts upstream google-research/vmoe (and ViT) checkpoints to keras_vmoe.

Sources:

* vmoe "partitioned" checkpoints (`<prefix>.index` + `<prefix>.data-*`, the
  released `gs://vmoe_checkpoints/...`): V-MoE (Token Choice; Expert Choice
  with `router="expert_choice"`), E³ and Soft MoE, plus dense ViTs saved by
  vmoe. Read leaf by leaf (`keras_vmoe.checkpoints.partitioned`), so the
  peak memory is the Keras model plus about one leaf.
* `.npz` checkpoints of google-research/vision_transformer (dense ViT; see
  `keras_vmoe.checkpoints.vit_npz`).
* checkpoints of the upstream trainer, i.e. whole train states: Orbax
  `CheckpointManager` directories (`workdir/ckpt`, one step or its `state`
  item; needs `keras-vmoe[orbax]`) and partitioned `workdir/ckpt_<step>`
  prefixes. Only the `params` subtree (or an EMA/`target` one) is read, at
  the latest step or `step=...` (`keras_vmoe.checkpoints.train_state`).
* an in-memory `{path: array}` dict in any of those namings.

The architecture is read from the parameter shapes (`infer.py`); the
routing, which the parameters do not record, comes from the preset catalog
(`preset=...`) and/or explicit arguments (`RoutingSettings`).

Name mapping (upstream, canonical vmoe naming -> Keras `variable.path`):

```
embedding/{kernel,bias}                      patch_embedding/{kernel,bias}
cls                                          patch_embedding/cls
Encoder/posembed_input/pos_embedding         position_embedding/embedding
Encoder/encoderblock_i/LayerNorm_{0,1}       encoderblock_i/layer_norm_{0,1}
    scale, bias                                  gamma, beta
Encoder/encoderblock_i/SelfAttention/X       encoderblock_i/attention/X
    X = query, key, value, out {kernel,bias}; query_ln, key_ln scale -> gamma
Encoder/encoderblock_i/Mlp/Dense_j           encoderblock_i/mlp/dense_j
Encoder/encoderblock_i/Moe/Mlp/Dense_j/kernel  encoderblock_i/moe/experts/kernel_j
Encoder/encoderblock_i/Moe/Mlp/Dense_j/bias    encoderblock_i/moe/experts/bias_j
Encoder/encoderblock_i/Moe/Router/dense/kernel encoderblock_i/moe/router/kernel
Encoder/encoderblock_i/Moe/Router/{mu,scale}   encoderblock_i/moe/router/{mu,scale}
Encoder/encoder_norm                         encoder_norm
MapHead/{probe, MultiHeadDotProductAttention, LayerNorm, Mlp/Dense_j}
                                             map_head/{probe, attention, layer_norm, mlp/dense_j}
pre_logits, head                             pre_logits, head
```

Every array keeps its layout (flax and keras_vmoe use the same kernel
layouts). Two reshapes are allowed: an E³ router kernel stored 2-D
`(D, E)` becomes `(D, N, E/N)` (expert `e = n·E/N + j`), and a learned
position embedding is resized bilinearly (upstream's `vit_zoom`) when the
model is built for another `image_size`.

Command line: `python checkpoints_conversion/convert_vmoe_checkpoints.py`
or `keras-vmoe convert` (both call `main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import posixpath
import re
import sys
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_vmoe.checkpoints import infer
from keras_vmoe.checkpoints import partitioned
from keras_vmoe.checkpoints import train_state
from keras_vmoe.checkpoints import vit_npz
from keras_vmoe.checkpoints.infer import ConversionError
from keras_vmoe.checkpoints.infer import RoutingSettings
from keras_vmoe.checkpoints.infer import UpstreamArchitecture
from keras_vmoe.checkpoints.infer import backbone_config
from keras_vmoe.checkpoints.infer import canonicalize
from keras_vmoe.checkpoints.infer import infer_architecture
from keras_vmoe.checkpoints.train_state import ResolvedCheckpoint

__all__ = [
    "ConversionError",
    "RoutingSettings",
    "ValidationError",
    "WeightAssignment",
    "build_model_from_upstream",
    "conversion_plan",
    "convert_to_preset",
    "convert_vit_npz_to_preset",
    "iter_upstream_params",
    "keras_path_for",
    "load_upstream_params",
    "main",
    "preset_for_upstream",
    "read_upstream_shapes",
    "resolve_upstream",
    "routing_from_preset",
    "validate",
]


logger = logging.getLogger(__name__)


class ValidationError(AssertionError):
    """Converted model outputs differ from the reference outputs."""


# ---------------------------------------------------------------------------
# Reading upstream parameters.
# ---------------------------------------------------------------------------


def _is_npz(source) -> bool:
    return isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(".npz")


def _strip_index_suffix(prefix: str) -> str:
    """Accepts `P`, `P.index` or `P.data-00000-of-00001` for a prefix `P`."""
    prefix = os.fspath(prefix)
    if prefix.endswith(".index"):
        return prefix[: -len(".index")]
    match = re.match(r"^(.*)\.data-\d{5}-of-\d{5}$", prefix)
    return match.group(1) if match else prefix


def resolve_upstream(source, step: int | None = None):
    """Finds what to read in an upstream source (no array is read).

    Args:
        source: a partitioned checkpoint prefix, a trainer checkpoint (Orbax
            directory, `workdir/ckpt` prefix or workdir; see
            `keras_vmoe.checkpoints.train_state`), a `.npz` path, a mapping
            `{path: array}` or an already resolved checkpoint.
        step: training step to convert (trainer checkpoints only; default
            the latest).

    Returns:
        A `ResolvedCheckpoint` for checkpoint paths; `.npz` paths are
        returned as they are, mappings with their parameter subtree only
        (a flat train state `{"params/...": ..., "opt_state/...": ...}`
        gives `{"...": ...}`).

    Raises:
        keras_vmoe.checkpoints.CheckpointError: not a checkpoint, no such
            step (the available ones are listed), a train state without
            parameters, Orbax not installed (`OrbaxNotInstalledError`).
        ValueError: `step` given for a source that has no steps.
    """
    if isinstance(source, (Mapping, ResolvedCheckpoint)) or _is_npz(source):
        if step is not None:
            what = ("a .npz file" if _is_npz(source) else
                    "an in-memory parameter dict" if isinstance(source, Mapping) else
                    "an already resolved checkpoint")
            raise ValueError(
                f"step={step!r} selects a step of a trainer checkpoint, but the "
                f"source is {what}, which has no steps."
            )
        if isinstance(source, Mapping) and source:
            # A flat train state in memory: keep its parameter subtree.
            subtree = train_state.select_params_subtree(source, "The parameter dict")
            if subtree is not None:
                return {key[len(subtree) + 1:]: value for key, value in source.items()
                        if key.startswith(subtree + "/")}
        return source
    return train_state.resolve_checkpoint(source, step=step)


def read_upstream_shapes(source) -> dict[str, tuple[int, ...]]:
    """`{upstream_path: shape}` of a checkpoint, without reading the weights.

    Args:
        source: a partitioned checkpoint prefix (local or gs://), a trainer
            checkpoint (its latest step), a `ResolvedCheckpoint`, a `.npz`
            path, or a mapping `{path: array}`.
    """
    source = resolve_upstream(source)
    if isinstance(source, Mapping):
        return {k: tuple(np.shape(v)) for k, v in source.items()}
    if isinstance(source, ResolvedCheckpoint):
        return dict(source.shapes)
    return vit_npz.read_shapes(source)


def iter_upstream_params(source) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(upstream_path, array)` pairs of the model parameters only
    (one leaf in memory at a time, except for Orbax checkpoints, whose
    parameter subtree is restored at once)."""
    source = resolve_upstream(source)
    if isinstance(source, Mapping):
        for key, value in source.items():
            yield key, np.asarray(value)
        return
    if isinstance(source, ResolvedCheckpoint):
        yield from source.iter_params()
        return
    yield from vit_npz.iter_arrays(source)


def load_upstream_params(prefix, step: int | None = None) -> dict[str, np.ndarray]:
    """Reads an upstream checkpoint into a flat `{path: array}` dict.

    Args:
        prefix: a vmoe partitioned checkpoint prefix (local path or gs://;
            `P.index` is accepted too), a trainer checkpoint (see
            `resolve_upstream`) or a vision_transformer `.npz` file.
        step: training step of a trainer checkpoint (default: the latest).

    Returns:
        `{"/"-joined upstream path: numpy array}` (bfloat16 arrays keep the
        `ml_dtypes.bfloat16` dtype).

    Raises:
        keras_vmoe.checkpoints.CheckpointError: missing, truncated or
            malformed files.
    """
    source = resolve_upstream(prefix, step)
    if isinstance(source, ResolvedCheckpoint):
        if source.format == "partitioned" and source.subtree is None:
            return partitioned.restore_flat(source.location)
        return dict(source.iter_params())
    return dict(iter_upstream_params(source))


# ---------------------------------------------------------------------------
# Name mapping.
# ---------------------------------------------------------------------------

_LN = {"scale": "gamma", "bias": "beta"}
_BLOCK = r"Encoder/encoderblock_(?P<i>\d+)"
_ATTENTION = r"(?P<p>query|key|value|out)/(?P<w>kernel|bias)"
_QK_LN = r"(?P<p>query_ln|key_ln)/scale"

# (regex on the canonical path, Keras path template). Templates use the
# named groups; `{ln}` is the LayerNorm weight name of group `w`.
_RULES = [
    (r"embedding/(?P<w>kernel|bias)", "patch_embedding/{w}"),
    (r"cls", "patch_embedding/cls"),
    (r"Encoder/posembed_input/pos_embedding", "position_embedding/embedding"),
    (r"Encoder/encoder_norm/(?P<w>scale|bias)", "encoder_norm/{ln}"),
    (_BLOCK + r"/LayerNorm_(?P<j>[01])/(?P<w>scale|bias)",
     "encoderblock_{i}/layer_norm_{j}/{ln}"),
    (_BLOCK + r"/SelfAttention/" + _ATTENTION, "encoderblock_{i}/attention/{p}/{w}"),
    (_BLOCK + r"/SelfAttention/" + _QK_LN, "encoderblock_{i}/attention/{p}/gamma"),
    (_BLOCK + r"/Mlp/Dense_(?P<j>[01])/(?P<w>kernel|bias)",
     "encoderblock_{i}/mlp/dense_{j}/{w}"),
    (_BLOCK + r"/Moe/Mlp/Dense_(?P<j>[01])/(?P<w>kernel|bias)",
     "encoderblock_{i}/moe/experts/{w}_{j}"),
    (_BLOCK + r"/Moe/Router/dense/kernel", "encoderblock_{i}/moe/router/kernel"),
    (_BLOCK + r"/Moe/Router/(?P<w>mu|scale)", "encoderblock_{i}/moe/router/{w}"),
    (r"MapHead/probe", "map_head/probe"),
    (r"MapHead/MultiHeadDotProductAttention/" + _ATTENTION,
     "map_head/attention/{p}/{w}"),
    (r"MapHead/MultiHeadDotProductAttention/" + _QK_LN, "map_head/attention/{p}/gamma"),
    (r"MapHead/LayerNorm/(?P<w>scale|bias)", "map_head/layer_norm/{ln}"),
    (r"MapHead/Mlp/Dense_(?P<j>[01])/(?P<w>kernel|bias)", "map_head/mlp/dense_{j}/{w}"),
    (r"pre_logits/(?P<w>kernel|bias)", "pre_logits/{w}"),
    (r"head/(?P<w>kernel|bias)", "head/{w}"),
]
_COMPILED_RULES = [(re.compile(pattern + r"$"), template) for pattern, template in _RULES]


def keras_path_for(canonical_path: str) -> str | None:
    """The Keras weight path of a canonical upstream path (None if unknown)."""
    for pattern, template in _COMPILED_RULES:
        match = pattern.match(canonical_path)
        if match:
            groups = match.groupdict()
            if "w" in groups:
                groups["ln"] = _LN.get(groups["w"], groups["w"])
            return template.format(**groups)
    return None


@dataclasses.dataclass(frozen=True)
class WeightAssignment:
    """How one upstream array becomes one Keras weight.

    Attributes:
        upstream_path: path in the checkpoint.
        canonical_path: the same path in vmoe naming.
        keras_path: `variable.path` of the target weight.
        upstream_shape: stored shape.
        keras_shape: shape of the Keras weight.
        transform: None (as is), "reshape" (E³ router `(D, E)` ->
            `(D, N, E/N)`) or "resize_position_embedding".
    """

    upstream_path: str
    canonical_path: str
    keras_path: str
    upstream_shape: tuple[int, ...]
    keras_shape: tuple[int, ...]
    transform: str | None = None


def _model_weights(model) -> dict[str, Any]:
    weights = {}
    for variable in model.weights:
        if variable.path in weights and weights[variable.path] is not variable:
            raise ConversionError(
                f"The model has two weights with path {variable.path!r}; cannot map "
                "upstream names unambiguously."
            )
        weights[variable.path] = variable
    return weights


def conversion_plan(
    shapes: Mapping[str, Any], model, arch: UpstreamArchitecture | None = None
) -> dict[str, WeightAssignment]:
    """Checks that a checkpoint fits a model and says where each array goes.

    Args:
        shapes: `{upstream_path: shape}`.
        model: the Keras model (backbone or task) to fill.
        arch: the architecture inferred from `shapes` (for the position
            embedding resize); inferred if not given.

    Returns:
        `{upstream_path: WeightAssignment}`.

    Raises:
        ConversionError: listing every upstream array without a Keras
            counterpart, every Keras weight left without a value, and every
            shape mismatch (upstream path, Keras path, both shapes).
    """
    shapes = {k: tuple(int(d) for d in getattr(v, "shape", v)) for k, v in shapes.items()}
    if arch is None:
        arch = infer_architecture(shapes)
    targets = _model_weights(model)
    plan: dict[str, WeightAssignment] = {}
    unmapped, missing_target, mismatches = [], [], []
    claimed: dict[str, str] = {}
    for canonical, upstream in sorted(canonicalize(shapes).items()):
        keras_path = keras_path_for(canonical)
        if keras_path is None:
            unmapped.append(f"{upstream} {shapes[upstream]}")
            continue
        if keras_path not in targets:
            missing_target.append(f"{upstream} -> {keras_path} (not in the model)")
            continue
        if keras_path in claimed:
            raise ConversionError(
                f"Upstream arrays {claimed[keras_path]!r} and {upstream!r} both map to "
                f"the Keras weight {keras_path!r}."
            )
        claimed[keras_path] = upstream
        src, dst = shapes[upstream], tuple(int(d) for d in targets[keras_path].shape)
        transform = None
        if src != dst:
            if (
                canonical.endswith("/Moe/Router/dense/kernel")
                and len(src) == 2 and len(dst) == 3
                and src[0] == dst[0] and src[1] == dst[1] * dst[2]
            ):
                transform = "reshape"
            elif (
                keras_path == "position_embedding/embedding"
                and len(src) == 3 and len(dst) == 3
                and src[0] == dst[0] == 1 and src[2] == dst[2]
                and arch.checkpoint_grid is not None
            ):
                transform = "resize_position_embedding"
            elif src == () and dst in ((1,),) or src in ((1,),) and dst == ():
                transform = "reshape"
            else:
                mismatches.append(
                    f"upstream {upstream!r} has shape {src} but Keras weight "
                    f"{keras_path!r} has shape {dst}"
                )
                continue
        plan[upstream] = WeightAssignment(
            upstream_path=upstream,
            canonical_path=canonical,
            keras_path=keras_path,
            upstream_shape=src,
            keras_shape=dst,
            transform=transform,
        )
    unassigned = sorted(set(targets) - set(claimed))
    problems = []
    if mismatches:
        problems.append("Shape mismatches:\n  " + "\n  ".join(mismatches))
    if unmapped:
        problems.append(
            "Upstream arrays with no Keras counterpart (unsupported parameters):\n  "
            + "\n  ".join(unmapped)
        )
    if missing_target:
        problems.append(
            "Upstream arrays whose Keras weight the model lacks:\n  "
            + "\n  ".join(missing_target)
        )
    if unassigned:
        problems.append(
            "Keras weights no upstream array provides:\n  "
            + "\n  ".join(f"{p} {tuple(targets[p].shape)}" for p in unassigned)
        )
    if problems:
        raise ConversionError(
            "The checkpoint does not match the model "
            f"({arch.summary()}):\n" + "\n".join(problems)
        )
    return plan


def _transform(value: np.ndarray, assignment: WeightAssignment,
               arch: UpstreamArchitecture) -> np.ndarray:
    if assignment.transform == "reshape":
        return value.reshape(assignment.keras_shape)
    if assignment.transform == "resize_position_embedding":
        from keras_vmoe.models.vit_layers import resize_position_embedding

        return resize_position_embedding(
            value.astype(np.float32), arch.grid, has_cls=arch.classifier == "token",
            old_grid=arch.checkpoint_grid,
        )
    return value


def _assign(model, plan: Mapping[str, WeightAssignment], arch: UpstreamArchitecture,
            leaves: Iterable[tuple[str, np.ndarray]]) -> None:
    targets = _model_weights(model)
    done = set()
    for path, value in leaves:
        assignment = plan.get(path)
        if assignment is None:  # Not in the plan: the plan already failed on it.
            raise ConversionError(f"Unexpected upstream array {path!r}.")
        if path in done:
            raise ConversionError(f"Upstream array {path!r} was read twice.")
        value = _checked_values(path, np.asarray(value))
        if tuple(value.shape) != assignment.upstream_shape:
            raise ConversionError(
                f"Upstream array {path!r} has shape {tuple(value.shape)}, but its "
                f"index says {assignment.upstream_shape}."
            )
        variable = targets[assignment.keras_path]
        value = _transform(value, assignment, arch)
        variable.assign(np.asarray(value, dtype=np.float32).astype(
            _numpy_dtype(variable.dtype), copy=False))
        done.add(path)
    missing = sorted(set(plan) - done)
    if missing:
        raise ConversionError(f"Upstream arrays were never read: {missing}")


def _is_float(dtype) -> bool:
    """Whether `dtype` is a real floating-point type (ml_dtypes' bfloat16 and
    float8 types, whose numpy kind is "V", included)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)


def _checked_values(path: str, value: np.ndarray) -> np.ndarray:
    """Refuses a leaf whose values cannot be a trained float parameter.

    Integer, bool or complex arrays would be truncated or lose their
    imaginary part when cast to the model's floats, and NaN/inf weights
    give non-finite logits (an all-NaN router kernel silently skips every
    MoE layer); both name the leaf.
    """
    if not _is_float(value.dtype):
        raise ConversionError(
            f"Upstream array {path!r} has dtype {value.dtype}, but parameters are "
            "floating point (float32, bfloat16, float16, float64). The "
            "checkpoint is corrupt or was edited."
        )
    finite = np.isfinite(value.astype(np.float32, copy=False))
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        raise ConversionError(
            f"Upstream array {path!r} holds {bad} non-finite value(s) (NaN or "
            f"inf) out of {value.size}; converted weights must be finite. The "
            "checkpoint is corrupt, or the run it comes from diverged."
        )
    return value


def _numpy_dtype(dtype) -> Any:
    name = str(getattr(dtype, "name", dtype))
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


# ---------------------------------------------------------------------------
# Routing from the preset catalog.
# ---------------------------------------------------------------------------


def _catalog():
    try:
        from keras_vmoe.presets import catalog
    except ImportError:  # pragma: no cover - the presets package is optional here
        return {}, {}
    return getattr(catalog, "PRESETS", {}), getattr(catalog, "ALIASES", {})


def _catalog_entry(name: str) -> tuple[str, Mapping[str, Any]]:
    presets, aliases = _catalog()
    resolved = aliases.get(name, name)
    if resolved not in presets:
        raise ValueError(
            f"Unknown preset {name!r}. Known presets with upstream weights: "
            f"{sorted(n for n, p in presets.items() if p.get('weights'))}"
        )
    return resolved, presets[resolved]


def preset_for_upstream(upstream: str) -> str | None:
    """The catalog preset whose released weights are `upstream` (or None)."""
    presets, _ = _catalog()
    upstream = _strip_index_suffix(os.fspath(upstream)).rstrip("/")
    base = posixpath.basename(upstream)
    by_base = None
    for name, entry in presets.items():
        weights = entry.get("weights") or {}
        source = weights.get("upstream")
        if not source:
            continue
        if source.rstrip("/") == upstream:
            return name
        if posixpath.basename(source.rstrip("/")) == base or name == base:
            by_base = name
    return by_base


def routing_from_preset(name: str) -> RoutingSettings:
    """Routing settings of a catalog preset (`keras_vmoe.presets.catalog`).

    The released upstream configs all route with the softmax Token Choice
    router and bfloat16 dispatch (Soft MoE: built in).
    """
    _, entry = _catalog_entry(name)
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


def _preset_defaults(name: str) -> dict[str, Any]:
    """Non-routing conversion defaults of a catalog preset."""
    _, entry = _catalog_entry(name)
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


# ---------------------------------------------------------------------------
# Building models.
# ---------------------------------------------------------------------------

_ROUTING_KEYS = set(RoutingSettings.fields())


def _split_routing(kwargs):
    routing = {k: kwargs.pop(k) for k in list(kwargs) if k in _ROUTING_KEYS}
    return routing


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
        params: a flat `{upstream_path: array}` dict (e.g. from
            `load_upstream_params`), a partitioned checkpoint prefix (local
            or gs://; streamed leaf by leaf), a trainer checkpoint (Orbax
            directory or `ckpt_<step>` prefix; its parameters only), a
            `ResolvedCheckpoint` or a `.npz` path.
        preset: catalog preset name whose routing (and head bias) to use.
        routing: `RoutingSettings` (or a dict of them) to start from instead
            of the preset's.
        image_size: resolution of the Keras model (default: the checkpoint's,
            read from its position embedding); another size resizes the
            learned position embedding.
        position_embedding: for checkpoints without a learned one:
            "sincos2d" (default) or "none".
        ensemble_size: E³ members when the router kernel is stored 2-D.
        include_head: False returns the backbone only.
        head_bias_init: recorded in the task config (the weights are loaded).
        dtype: dtype policy of the model (default float32).
        step: training step of a trainer checkpoint (default: the latest).
        **routing_overrides: any `RoutingSettings` field (`router`,
            `num_selected_experts`, `capacity_factor`,
            `capacity_ceil_or_round`, `capacity_multiple_of`, `group_size`,
            `images_per_group`, `batch_priority`, `bfloat16_dispatch`,
            `dispatch`); they take precedence over `preset` and `routing`.

    Returns:
        An `ImageClassifier` (an `EnsembleImageClassifier` for E³) when the
        checkpoint has a `head` and `include_head`, else a
        `VisionTransformerBackbone`, with every weight loaded.

    Raises:
        ConversionError: the checkpoint is not a supported model, a shape
            does not match (the error names the upstream path, the Keras path
            and both shapes), an upstream array has no Keras counterpart or a
            Keras weight gets no value (the error lists them).
        keras_vmoe.checkpoints.CheckpointError: unreadable checkpoint files.
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
            # Only matters for E³ checkpoints storing the router kernel 2-D.
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
    config = backbone_config(arch, settings)
    model = _build_keras_model(config, arch, include_head, head_bias_init, dtype)
    if not include_head:
        shapes = {k: v for k, v in shapes.items()
                  if not re.search(r"(^|/)head/(kernel|bias)$", k)}
    plan = conversion_plan(shapes, model, arch)
    leaves = iter_upstream_params(params)
    if not include_head:
        leaves = ((k, v) for k, v in leaves if k in plan)
    _assign(model, plan, arch, leaves)
    return model


def _build_keras_model(config, arch, include_head, head_bias_init, dtype):
    from keras_vmoe.models import EnsembleImageClassifier
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone

    if dtype is not None:
        config = dict(config, dtype=dtype)
    backbone = VisionTransformerBackbone(**config)
    if not include_head or not arch.num_classes:
        return backbone
    task_cls = EnsembleImageClassifier if arch.ensemble_size > 1 else ImageClassifier
    return task_cls(
        backbone,
        num_classes=arch.num_classes,
        head_bias_init=0.0 if head_bias_init is None else float(head_bias_init),
    )


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


def _predict(model, inputs):
    if hasattr(model, "predict_on_batch"):
        return np.asarray(model.predict_on_batch(inputs))
    return np.asarray(model(inputs, training=False))


def validate(model, inputs, expected_logits, atol: float = 1e-4) -> float:
    """Checks a converted model against reference outputs.

    The whole `inputs` batch goes through the model in one call (routing
    groups depend on which images share a batch, as upstream).

    Args:
        model: converted model (task or backbone).
        inputs: images `(B, H, W, C)` (array or `.npy` path).
        expected_logits: reference outputs (array or `.npy` path). For E³
            the upstream `(B·N, C)` layout and the Keras `(B, N, C)` one are
            both accepted.
        atol: largest allowed absolute difference.

    Returns:
        The max absolute difference.

    Raises:
        ValidationError: if the difference exceeds `atol` (or the shapes do
            not match).
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = np.load(inputs)
    if isinstance(expected_logits, (str, os.PathLike)):
        expected_logits = np.load(expected_logits)
    inputs = np.asarray(inputs, dtype=np.float32)
    expected = np.asarray(expected_logits, dtype=np.float32)
    actual = _predict(model, inputs).astype(np.float32)
    if actual.shape != expected.shape:
        if actual.size != expected.size:
            raise ValidationError(
                f"Output shape {actual.shape} does not match the reference shape "
                f"{expected.shape}."
            )
        expected = expected.reshape(actual.shape)
    diff = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    if not np.isfinite(diff) or diff > atol:
        raise ValidationError(
            f"Converted model outputs differ from the reference: max abs diff "
            f"{diff:.3g} > atol {atol:g}.{_routing_hint(model)}"
        )
    return diff


def _routing_hint(model):
    """Reminds that the routing settings must match the reference run's."""
    backbone = getattr(model, "backbone", model)
    moe = getattr(backbone, "moe", None)
    if not moe or moe.get("type", "sparse") == "soft":
        return ""
    router = dict(moe.get("router") or {})
    grouping = (
        {"images_per_group": moe["images_per_group"]}
        if moe.get("images_per_group")
        else {"group_size": moe.get("group_size") or "all"}
    )
    used = {
        **grouping,
        **{
            key: router[key]
            for key in ("num_selected_experts", "capacity_factor", "batch_priority")
            if key in router
        },
        "bfloat16_dispatch": moe.get("bfloat16_dispatch", False),
    }
    settings = ", ".join(f"{key}={value!r}" for key, value in used.items())
    return (
        " Routing settings are not stored in checkpoints and must match the run "
        f"that produced the reference (used: {settings}); set them with "
        "--group-size/--images-per-group, --capacity-factor, "
        "--num-selected-experts, --[no-]batch-priority, --no-bf16-dispatch."
    )


# ---------------------------------------------------------------------------
# Presets.
# ---------------------------------------------------------------------------


def convert_to_preset(
    upstream_prefix,
    output_dir,
    preset_name: str | None = None,
    *,
    overwrite: bool = False,
    validate_inputs=None,
    validate_logits=None,
    atol: float = 1e-4,
    image_size=None,
    position_embedding: str | None = None,
    ensemble_size: int | None = None,
    step: int | None = None,
    **routing_overrides,
) -> str:
    """Converts an upstream checkpoint into a keras_vmoe preset directory.

    The model is built and loaded (and validated, if asked) first; the
    preset is then written with `keras_vmoe.presets.save_to_preset`, which
    writes a temporary sibling directory and renames it to `output_dir`, so
    a failure at any point leaves no (partial) preset behind.

    Args:
        upstream_prefix: vmoe partitioned checkpoint prefix (local or gs://),
            a trainer checkpoint (Orbax directory, `ckpt_<step>` prefix or
            workdir), a `ResolvedCheckpoint` or a vision_transformer `.npz`
            path.
        output_dir: local directory of the preset. It must not exist unless
            `overwrite` (then an existing preset directory is replaced).
        preset_name: catalog preset giving the routing settings and recorded
            in `metadata.json` (default: the catalog entry whose released
            weights are `upstream_prefix`, if any; else the defaults of
            `RoutingSettings`).
        overwrite: replace an existing preset at `output_dir`.
        validate_inputs, validate_logits: optional reference images and
            logits (arrays or `.npy` paths) checked with `validate` before
            anything is written.
        atol: tolerance of that check.
        image_size, position_embedding, ensemble_size: see
            `build_model_from_upstream`.
        step: training step of a trainer checkpoint (default: the latest);
            recorded in `metadata.json` with the checkpoint format and the
            parameter subtree used.
        **routing_overrides: `RoutingSettings` fields overriding the
            catalog's.

    Returns:
        The absolute path of the preset directory.

    Raises:
        ConversionError, keras_vmoe.checkpoints.CheckpointError: the
            checkpoint cannot be converted (nothing is written).
        ValidationError: the outputs differ from the reference (nothing is
            written).
        FileExistsError: `output_dir` exists and `overwrite` is False.
    """
    from keras_vmoe.presets import save_to_preset
    from keras_vmoe.presets.api import local_directory

    output_dir = local_directory(output_dir, "convert_to_preset")
    if os.path.exists(output_dir) and not overwrite:
        raise FileExistsError(
            f"{output_dir} already exists; pass overwrite=True (--overwrite) to "
            "replace it."
        )
    resolved = resolve_upstream(upstream_prefix, step)
    source = (os.fspath(upstream_prefix)
              if isinstance(upstream_prefix, (str, os.PathLike)) else
              resolved.location if isinstance(resolved, ResolvedCheckpoint) else None)
    if preset_name is None and source is not None:
        preset_name = preset_for_upstream(source)
    model = build_model_from_upstream(
        resolved, preset=preset_name, image_size=image_size,
        position_embedding=position_embedding, ensemble_size=ensemble_size,
        **routing_overrides,
    )
    diff = None
    if validate_inputs is not None or validate_logits is not None:
        if validate_inputs is None or validate_logits is None:
            raise ValueError("Pass both validate_inputs and validate_logits.")
        diff = validate(model, validate_inputs, validate_logits, atol=atol)
    backbone = getattr(model, "backbone", model)
    metadata = {
        "conversion": {
            "source": source or "<in-memory params>",
            "catalog_preset": preset_name,
            "routing_overrides": {
                k: v for k, v in routing_overrides.items() if v is not None
            },
            "moe": backbone.moe,
            "validation_max_abs_diff": diff,
            "validation_atol": atol if diff is not None else None,
        }
    }
    if isinstance(resolved, ResolvedCheckpoint):
        metadata["conversion"]["checkpoint"] = resolved.metadata()
    if preset_name is not None:
        from keras_vmoe.presets import resolve_preset_name

        if resolve_preset_name(preset_name) is None:
            metadata["conversion"]["catalog_preset"] = None
            preset_name = None
    return save_to_preset(model, output_dir, preset_name=preset_name, metadata=metadata)


def convert_vit_npz_to_preset(source, output_dir, preset_name: str | None = None,
                              **kwargs) -> str:
    """`convert_to_preset` for a google-research/vision_transformer `.npz`."""
    if not _is_npz(source):
        raise ValueError(f"Expected a .npz file. Received: {os.fspath(source)!r}")
    return convert_to_preset(source, output_dir, preset_name=preset_name, **kwargs)


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def _group_size(value: str):
    if value == "all":
        return "all"
    try:
        return int(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"--group-size must be an integer or 'all', got {value!r}"
        ) from error


def _capacity_factor(value: str) -> float:
    from keras_vmoe.layers.capacity import validate_capacity_factor

    try:
        number = float(value)
    except ValueError:
        number = value  # validate_capacity_factor names the non-number
    try:
        return validate_capacity_factor(number, "--capacity-factor")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--capacity-factor must be a finite number > 0, got {value!r}"
        ) from None


def _image_size(value: str):
    parts = value.lower().replace("x", ",").split(",")
    try:
        sizes = [int(p) for p in parts if p]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"bad --image-size {value!r}") from error
    if len(sizes) == 1:
        return sizes[0]
    if len(sizes) == 2:
        return tuple(sizes)
    raise argparse.ArgumentTypeError(f"bad --image-size {value!r}")


def _step(value: str) -> int:
    try:
        step = int(value)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(
            f"--step must be a non-negative integer, got {value!r}")
    return step


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of the converter's command line."""
    parser = argparse.ArgumentParser(
        prog=prog or "keras-vmoe convert",
        description=(
            "Convert a google-research/vmoe checkpoint (partitioned .index/.data-*"
            " prefix, local or gs://; a checkpoint of the vmoe trainer: Orbax "
            "ckpt/ directory or ckpt_<step> prefix) or a "
            "google-research/vision_transformer .npz into a keras_vmoe preset "
            "directory."
        ),
    )
    parser.add_argument("--upstream", required=True,
                        help="checkpoint prefix (without .index), .npz path, or a "
                        "trainer checkpoint: Orbax directory (workdir/ckpt, "
                        "ckpt/<step> or ckpt/<step>/state; needs "
                        "keras-vmoe[orbax]), workdir/ckpt prefix or workdir")
    parser.add_argument("--step", type=_step, default=None,
                        help="training step to convert (default: the latest)")
    parser.add_argument("--output", required=True, help="preset directory to write")
    parser.add_argument("--preset", default=None,
                        help="catalog preset whose routing settings to use "
                        "(default: the preset released as --upstream, if any)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output directory")
    routing = parser.add_argument_group(
        "routing (not stored in checkpoints; overrides the preset's)")
    routing.add_argument("--router", choices=infer.ROUTER_NAMES, default=None)
    routing.add_argument("--num-selected-experts", type=int, default=None, metavar="K")
    routing.add_argument("--capacity-factor", type=_capacity_factor, default=None)
    routing.add_argument("--capacity-ceil-or-round", choices=("ceil", "round"),
                         default=None)
    routing.add_argument("--capacity-multiple-of", type=int, default=None)
    routing.add_argument("--group-size", type=_group_size, default=None,
                         help="tokens per routing group (E³: counting the copies) "
                         "or 'all'")
    routing.add_argument("--images-per-group", type=int, default=None)
    bpr = routing.add_mutually_exclusive_group()
    bpr.add_argument("--batch-priority", dest="batch_priority", action="store_true",
                     default=None, help="Batch Prioritized Routing")
    bpr.add_argument("--no-batch-priority", dest="batch_priority", action="store_false")
    routing.add_argument("--no-bf16-dispatch", dest="bfloat16_dispatch",
                         action="store_false", default=None,
                         help="do not round expert inputs/outputs to bfloat16 "
                         "(upstream's released configs do)")
    routing.add_argument("--dispatch", choices=("index", "einsum"), default=None)
    arch = parser.add_argument_group("architecture")
    arch.add_argument("--image-size", type=_image_size, default=None,
                      help="resolution to build the model at (resizes the position "
                      "embedding); default: the checkpoint's")
    arch.add_argument("--position-embedding", choices=("sincos2d", "none"),
                      default=None,
                      help="for checkpoints without a learned position embedding")
    arch.add_argument("--ensemble-size", type=int, default=None,
                      help="E³ members when the router kernel is stored 2-D")
    check = parser.add_argument_group("validation")
    check.add_argument("--validate-inputs", default=None, help="images .npy (NHWC)")
    check.add_argument("--validate-logits", default=None, help="reference logits .npy")
    check.add_argument("--atol", type=float, default=1e-4)
    return parser


def main(argv=None, prog: str | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if (args.validate_inputs is None) != (args.validate_logits is None):
        parser.error("--validate-inputs and --validate-logits go together")
    routing = {
        key: getattr(args, key)
        for key in RoutingSettings.fields()
        if getattr(args, key, None) is not None
    }
    try:
        source = resolve_upstream(args.upstream, args.step)
        if isinstance(source, ResolvedCheckpoint):
            print(f"Converting {source.describe()}", file=sys.stderr, flush=True)
        out = convert_to_preset(
            source,
            args.output,
            preset_name=args.preset,
            overwrite=args.overwrite,
            validate_inputs=args.validate_inputs,
            validate_logits=args.validate_logits,
            atol=args.atol,
            image_size=args.image_size,
            position_embedding=args.position_embedding,
            ensemble_size=args.ensemble_size,
            **routing,
        )
    except (ConversionError, ValidationError, partitioned.CheckpointError,
            ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ImportError as error:
        if "pip install" not in str(error):  # not a missing optional dependency
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    step = getattr(source, "step", None)
    print(f"Wrote preset {out}" + (f" (step {step})" if step is not None else ""))
    return 0

