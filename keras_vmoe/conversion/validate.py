"""Checking a converted model against reference outputs."""

from __future__ import annotations

import os

import numpy as np


class ValidationError(AssertionError):
    """Converted model outputs differ from the reference outputs."""


def validate(model, inputs, expected_logits, atol: float = 1e-4) -> float:
    """Checks a converted model against reference outputs.

    The batch goes through in one call (routing groups depend on it).

    Args:
        model: converted model (task or backbone).
        inputs: images `(B, H, W, C)` (array or `.npy` path).
        expected_logits: reference outputs (array or `.npy` path); for E³
            `(B·N, C)` or `(B, N, C)`.
        atol: largest allowed absolute difference.

    Returns:
        The max absolute difference.

    Raises:
        ValidationError: the difference exceeds `atol`, or shapes differ.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = np.load(inputs)
    if isinstance(expected_logits, (str, os.PathLike)):
        expected_logits = np.load(expected_logits)
    inputs = np.asarray(inputs, dtype=np.float32)
    expected = np.asarray(expected_logits, dtype=np.float32)
    if hasattr(model, "predict_on_batch"):
        actual = np.asarray(model.predict_on_batch(inputs)).astype(np.float32)
    else:
        actual = np.asarray(model(inputs, training=False)).astype(np.float32)
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
    if moe.get("images_per_group"):
        used = {"images_per_group": moe["images_per_group"]}
    else:
        used = {"group_size": moe.get("group_size") or "all"}
    for key in ("num_selected_experts", "capacity_factor", "batch_priority"):
        if key in router:
            used[key] = router[key]
    used["bfloat16_dispatch"] = moe.get("bfloat16_dispatch", False)
    settings = ", ".join(f"{key}={value!r}" for key, value in used.items())
    return (
        " Routing settings are not stored in checkpoints and must match the run "
        f"that produced the reference (used: {settings}); set them with "
        "--group-size/--images-per-group, --capacity-factor, "
        "--num-selected-experts, --[no-]batch-priority, --no-bf16-dispatch."
    )
