"""Copying weights between backbones of different image sizes."""

import keras

from keras_vmoe.models.vit_embeddings import resize_position_embedding


def load_weights_from(target, source):
    """Copies the weights of `source` into `target`, resizing position embeddings.

    Weights are matched by `variable.path`. A learned position embedding
    whose grid differs (e.g. a 224px model loaded into a 384px one) is
    resized with `resize_position_embedding`. Every weight of `target`
    must have a counterpart of the same shape otherwise.

    Args:
        target: a `VisionTransformerBackbone`.
        source: a `VisionTransformerBackbone` (or any model with the same
            weight paths).
    """
    source_weights = {v.path: v for v in source.weights}
    for variable in target.weights:
        if variable.path not in source_weights:
            raise ValueError(f"The source model has no weight `{variable.path}`.")
        value = keras.ops.convert_to_numpy(source_weights[variable.path].value)
        shape = tuple(variable.shape)
        if variable.path == "position_embedding/embedding" and value.shape != shape:
            value = resize_position_embedding(
                value,
                target.grid_size,
                has_cls=target.classifier == "token",
                old_grid=getattr(source, "grid_size", None),
            )
        if value.shape != shape:
            raise ValueError(
                f"Shape mismatch for `{variable.path}`: source {value.shape}, "
                f"target {shape}."
            )
        variable.assign(value)
