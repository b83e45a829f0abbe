"""Upstream parameter names -> Keras weights: the name map and the loading plan."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_vmoe.conversion.infer import ConversionError
from keras_vmoe.conversion.infer import UpstreamArchitecture
from keras_vmoe.conversion.infer import canonicalize
from keras_vmoe.conversion.infer import infer_architecture

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

    `transform` is None (as is), "reshape" or "resize_position_embedding".
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


def _shape_transform(canonical, keras_path, src, dst, arch):
    """The transform turning upstream shape `src` into Keras shape `dst`, or None."""
    if (
        canonical.endswith("/Moe/Router/dense/kernel")
        and len(src) == 2 and len(dst) == 3
        and src[0] == dst[0] and src[1] == dst[1] * dst[2]
    ):
        return "reshape"
    if (
        keras_path == "position_embedding/embedding"
        and len(src) == 3 and len(dst) == 3
        and src[0] == dst[0] == 1 and src[2] == dst[2]
        and arch.checkpoint_grid is not None
    ):
        return "resize_position_embedding"
    if (src, dst) in (((), (1,)), ((1,), ())):
        return "reshape"
    return None


def _check_plan_complete(arch, targets, claimed, unmapped, missing_target, mismatches):
    """Raises a `ConversionError` listing every problem the plan found."""
    unassigned = [f"{p} {tuple(targets[p].shape)}"
                  for p in sorted(set(targets) - set(claimed))]
    sections = (
        ("Shape mismatches", mismatches),
        ("Upstream arrays with no Keras counterpart (unsupported parameters)",
         unmapped),
        ("Upstream arrays whose Keras weight the model lacks", missing_target),
        ("Keras weights no upstream array provides", unassigned),
    )
    problems = [f"{title}:\n  " + "\n  ".join(items)
                for title, items in sections if items]
    if problems:
        raise ConversionError(
            "The checkpoint does not match the model "
            f"({arch.summary()}):\n" + "\n".join(problems)
        )


def conversion_plan(
    shapes: Mapping[str, Any], model, arch: UpstreamArchitecture | None = None
) -> dict[str, WeightAssignment]:
    """`{upstream_path: WeightAssignment}`: where each array of `shapes` goes
    in `model` (`arch` is inferred from `shapes` if None).

    Raises:
        ConversionError: listing every unmapped array, unassigned weight and
            shape mismatch.
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
            transform = _shape_transform(canonical, keras_path, src, dst, arch)
            if transform is None:
                mismatches.append(
                    f"upstream {upstream!r} has shape {src} but Keras weight "
                    f"{keras_path!r} has shape {dst}"
                )
                continue
        plan[upstream] = WeightAssignment(
            upstream, canonical, keras_path, src, dst, transform)
    _check_plan_complete(arch, targets, claimed, unmapped, missing_target, mismatches)
    return plan


def _transform(value: np.ndarray, assignment: WeightAssignment,
               arch: UpstreamArchitecture) -> np.ndarray:
    if assignment.transform == "reshape":
        return value.reshape(assignment.keras_shape)
    if assignment.transform == "resize_position_embedding":
        from keras_vmoe.models.vit_embeddings import (
            resize_position_embedding,  # lazy: conversion loads without Keras
        )

        return resize_position_embedding(
            value.astype(np.float32), arch.grid, has_cls=arch.classifier == "token",
            old_grid=arch.checkpoint_grid,
        )
    return value


def assign_weights(model, plan: Mapping[str, WeightAssignment], arch: UpstreamArchitecture,
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
    """Whether `dtype` is a real float type (ml_dtypes' kind-"V" ones included)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)


def _checked_values(path: str, value: np.ndarray) -> np.ndarray:
    """Refuses a leaf that is not float or holds NaN/inf values."""
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
