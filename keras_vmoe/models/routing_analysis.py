"""Running a backbone's encoder block by block (`run_encoder`): routing
metrics, expert assignments and intermediate tokens, compiled once per setting
on JAX (`jit_stateless`).
"""

import keras
import numpy as np
from keras import ops

from keras_vmoe.layers.partitioned_moe import tile_for_ensemble
from keras_vmoe.models.routing_control import compiled_function_cache


def run_encoder(backbone, images, training, last_block, block_fn):
    """Runs the embeddings and blocks `0..last_block`; returns the results not
    `None` of `block_fn(index, block, x) -> (x, result)` by block name."""
    x = backbone.get_layer("patch_embedding")(images)  # (B, T, D)
    x = backbone.get_layer("position_embedding")(x)
    x = backbone.get_layer("embedding_dropout")(x, training=training)
    first_moe = min(backbone.moe_layers) if backbone.moe_layers else None
    results = {}
    for i in range(last_block + 1):
        if backbone.ensemble_size > 1 and i == first_moe:
            x = tile_for_ensemble(x, backbone.ensemble_size)  # (B·N, T, D)
        block = backbone.get_layer(f"encoderblock_{i}")
        x, result = block_fn(i, block, x)
        if result is not None:
            results[block.name] = result
    return results


def token_assignments(layer, routing, input_shape):
    """Per-token expert use of `layer`'s `routing` of inputs of `input_shape`.

    Returns a dict of float32 tensors `(B, T, E)`: `"processed"`, the slots of
    each expert holding the token (Soft MoE: dispatch weights summed over the
    slots, and `"combine"`), and for Token Choice `"requested"`, the experts
    chosen before capacity.

    Examples:

    >>> from keras_vmoe.layers import MoeLayer
    >>> layer = MoeLayer(num_experts=4, mlp_dim=8)
    >>> x = keras.random.normal((2, 6, 4))
    >>> _, routing = layer(x, return_routing=True)
    >>> token_assignments(layer, routing, x.shape)["processed"].shape
    (2, 6, 4)
    """
    batch, tokens = input_shape[0], input_shape[1]
    out_shape = (batch, tokens, layer.num_experts)
    if not routing.is_sparse:
        # (G, S, E, P) -> (G, S, E)
        processed = ops.sum(ops.cast(routing.dispatch_weights, "float32"), axis=-1)
        combine = ops.sum(ops.cast(routing.combine_weights, "float32"), axis=-1)
        return {"processed": layer.ungroup_tokens(processed, out_shape),
                "combine": layer.ungroup_tokens(combine, out_shape)}
    buffer_token = routing.buffer_token  # (G, E, C), S marks an empty slot
    num_groups, num_experts, capacity = ops.shape(buffer_token)
    group_size = ops.shape(routing.gates)[1]  # S, padding included
    group_ids = ops.arange(0, num_groups, dtype="int32")[:, None, None]
    expert_ids = ops.arange(num_experts, dtype="int32")[None, :, None]
    segment = (group_ids * (group_size + 1) + buffer_token) * num_experts + expert_ids
    counts = ops.segment_sum(
        ops.ones((num_groups * num_experts * capacity,), "float32"),
        ops.reshape(segment, (-1,)),
        num_segments=num_groups * (group_size + 1) * num_experts,
    )
    counts = ops.reshape(counts, (num_groups, group_size + 1, num_experts))
    result = {"processed": layer.ungroup_tokens(counts[:, :group_size], out_shape)}
    if routing.token_expert is not None:
        chosen = ops.one_hot(routing.token_expert, num_experts, dtype="float32")
        requested = ops.sum(chosen, axis=-2)  # (G, S, K, E) -> (G, S, E)
        result["requested"] = layer.ungroup_tokens(requested, out_shape)
    return result


def block_assignments(block, x, training):
    """Runs an MoE block and reads its expert assignments."""
    y, routing = block(x, training=training, return_routing=True)
    result = token_assignments(block.moe_layer, routing, ops.shape(x))
    result["capacity"] = ops.convert_to_tensor(routing.capacity, "int32")
    return y, result


def _run_to_last_moe(backbone, images, training, moe_block_fn):
    moe_layers = set(backbone.moe_layers)

    def run_block(i, block, x):
        if i in moe_layers:
            return moe_block_fn(block, x)
        return block(x, training=training), None

    return run_encoder(backbone, images, training, max(moe_layers), run_block)


def _metrics(backbone, images, training):
    metrics = _run_to_last_moe(backbone, images, training, lambda block, x: block(
        x, training=training, return_metrics=True))
    metrics["auxiliary_loss"] = sum(
        ops.cast(m["auxiliary_loss"], "float32") for m in metrics.values()
    )
    return metrics


def _assignments(backbone, images, training):
    return _run_to_last_moe(backbone, images, training,
                            lambda block, x: block_assignments(block, x, training))


def jit_stateless(backbone, key, fn, images, jit_compile=True):
    """`fn(images)` over the backbone's variables: on JAX a `jax.jit` of a
    stateless run (cached per `key`, seed states written back), else eager."""
    if not (jit_compile and keras.backend.backend() == "jax"):
        return fn(images)
    import jax

    variables = list(backbone.variables)
    cache = compiled_function_cache(backbone)
    if key not in cache:

        def run(values, images):
            mapping = list(zip(variables, values, strict=True))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                result = fn(images)
            updated = [
                scope.get_current_value(v)
                if scope.get_current_value(v) is not None
                else value
                for v, value in zip(variables, values, strict=True)
            ]
            return result, updated

        cache[key] = jax.jit(run)
    result, updated = cache[key]([v.value for v in variables], images)
    for variable, value in zip(variables, updated, strict=True):
        if not variable.trainable:
            variable.assign(value)
    return result


def _analyse(backbone, kind, images, training, jit_compile):
    if not backbone.moe_layers:
        raise ValueError(
            f"This backbone has no MoE layers; there are no routing {kind}.")
    images = ops.convert_to_tensor(images, dtype="float32")
    run = {"metrics": _metrics, "assignments": _assignments}[kind]
    training = bool(training)
    return jit_stateless(backbone, (kind, training),
                         lambda x: run(backbone, x, training), images, jit_compile)


def routing_metrics(backbone, images, training=False, jit_compile=True):
    """See `VisionTransformerBackbone.routing_metrics`."""
    metrics = _analyse(backbone, "metrics", images, training, jit_compile)
    return keras.tree.map_structure(lambda v: np.asarray(v).item(), metrics)


def to_numpy_assignments(result):
    """Assignments as NumPy arrays, the capacities as Python ints."""
    return {
        block: {
            key: int(value) if key == "capacity" else np.asarray(value)
            for key, value in values.items()
        }
        for block, values in result.items()
    }


def routing_assignments(backbone, images, training=False, jit_compile=True):
    """See `VisionTransformerBackbone.routing_assignments`."""
    result = _analyse(backbone, "assignments", images, training, jit_compile)
    return to_numpy_assignments(result)
