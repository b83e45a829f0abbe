"""Converting an upstream checkpoint into a preset directory."""

from __future__ import annotations

import os

from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.conversion.build import build_model_from_upstream
from keras_vmoe.conversion.build import preset_for_upstream
from keras_vmoe.conversion.validate import validate
from keras_vmoe.formats.train_state import ResolvedCheckpoint
from keras_vmoe.formats.upstream import is_npz
from keras_vmoe.formats.upstream import resolve_upstream
from keras_vmoe.formats.urls import redact
from keras_vmoe.presets.save import local_directory
from keras_vmoe.presets.save import save_to_preset


def convert_to_preset(upstream_prefix, output_dir, preset_name: str | None = None,
                      *, overwrite: bool = False, validate_inputs=None,
                      validate_logits=None, atol: float = 1e-4, image_size=None,
                      position_embedding: str | None = None,
                      ensemble_size: int | None = None, step: int | None = None,
                      **routing_overrides) -> str:
    """Converts an upstream checkpoint into a keras_vmoe preset directory.

    The model is built, loaded and validated (if asked) before the preset is
    written atomically with `save_to_preset`: a failure leaves nothing behind.

    Args:
        upstream_prefix: vmoe checkpoint prefix (local or gs://), trainer
            checkpoint (Orbax directory, `ckpt_<step>` prefix or workdir),
            `ResolvedCheckpoint` or vision_transformer `.npz` path.
        output_dir: local directory of the preset; it must not exist unless
            `overwrite`.
        preset_name: catalog preset giving the routing settings, recorded in
            `metadata.json` (default: the entry whose released weights are
            `upstream_prefix`, if any; else `RoutingSettings` defaults).
        overwrite: replace an existing preset at `output_dir`.
        validate_inputs, validate_logits: optional reference images and
            logits (arrays or `.npy` paths) checked with `validate`.
        atol: tolerance of that check.
        image_size, position_embedding, ensemble_size: see
            `build_model_from_upstream`.
        step: training step of a trainer checkpoint (default: the latest),
            recorded in `metadata.json`.
        **routing_overrides: `RoutingSettings` fields overriding the catalog's.

    Returns:
        The absolute path of the preset directory.

    Raises:
        ConversionError, keras_vmoe.formats.CheckpointError: the
            checkpoint cannot be converted.
        ValidationError: the outputs differ from the reference.
        FileExistsError: `output_dir` exists and `overwrite` is False.
    """
    output_dir = local_directory(output_dir, "convert_to_preset")
    if os.path.exists(output_dir) and not overwrite:
        raise FileExistsError(
            f"{output_dir} already exists; pass overwrite=True (--overwrite) to "
            "replace it.")
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
            "source": redact(source) if source else "<in-memory params>",
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
    if preset_name is not None and resolve_preset_name(preset_name) is None:
        metadata["conversion"]["catalog_preset"] = None
        preset_name = None
    return save_to_preset(model, output_dir, preset_name=preset_name, metadata=metadata)


def convert_vit_npz_to_preset(source, output_dir, preset_name: str | None = None,
                              **kwargs) -> str:
    """`convert_to_preset` for a google-research/vision_transformer `.npz`."""
    if not is_npz(source):
        raise ValueError(f"Expected a .npz file. Received: {os.fspath(source)!r}")
    return convert_to_preset(source, output_dir, preset_name=preset_name, **kwargs)
