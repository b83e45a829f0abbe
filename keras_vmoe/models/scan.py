"""Scanned encoder blocks (`scan=True`, JAX): repeated blocks as one `lax.scan`.

The blocks are split into the fewest segments of identical repeated units (one
block, or a dense/MoE pair) and XLA compiles one unit per segment. Weights stay
per block (same paths); the scan stacks their values inside the step, and
outputs, gradients, losses and random numbers are those of the unscanned model.
"""

import json

import keras

from keras_vmoe.models.remat import check_option_backend
from keras_vmoe.models.remat import checkpointed
from keras_vmoe.models.remat import pure_call
from keras_vmoe.models.remat import stored_value
from keras_vmoe.utils import keras_internals

SCAN_BACKENDS = ("jax",)


def check_scan_backend(scan):
    """Raises a `ValueError` when `scan` is asked for on a backend without it."""
    check_option_backend("scan", scan, SCAN_BACKENDS,
                         "runs the encoder blocks as a `jax.lax.scan`")


def _without_name(config):
    return {k: v for k, v in config.items() if k != "name"}


def block_signature(block):
    """What must agree for two blocks to share one scan body (a string)."""
    configs = [_without_name(block.get_config())]
    if block.moe_layer is not None:
        configs.append(_without_name(block.moe_layer.get_config()))
    variables = [(v.name, tuple(v.shape), str(v.dtype), v.trainable)
                 for v in block.variables]
    return json.dumps([configs, variables], sort_keys=True, default=str)


def _runs(signatures, start, period):
    """How many repeats of `signatures[start:start + period]` start there."""
    unit = signatures[start:start + period]
    if len(unit) < period:
        return 0
    count = 1
    while signatures[start + count * period:start + (count + 1) * period] == unit:
        count += 1
    return count


def plan_segments(signatures, boundaries=()):
    """Splits blocks into the fewest segments of repeated units.

    Args:
        signatures: the blocks' `block_signature`s, in order.
        boundaries: block indices where a segment must start (the E³ tiling).

    Returns:
        A list of segments, each a list of units, each a list of block
        indices: e.g. `[[[0], [1], [2]], [[3, 4], [5, 6]]]`.
    """
    segments = []
    edges = sorted({0, len(signatures), *boundaries})
    for begin, end in zip(edges[:-1], edges[1:], strict=False):
        part = signatures[begin:end]
        # best[i]: (segments, plan) for part[i:], fewest segments.
        best = {len(part): (0, [])}
        for i in range(len(part) - 1, -1, -1):
            options = []
            for period in (1, 2):
                for units in range(1, _runs(part, i, period) + 1):
                    j = i + units * period
                    count, rest = best[j]
                    segment = [list(range(begin + i + u * period,
                                          begin + i + (u + 1) * period))
                               for u in range(units)]
                    # Ties go to the plan with fewer, longer scans.
                    options.append((count + 1, -units * period, [segment, *rest]))
            count, _, plan = min(options, key=lambda o: (o[0], o[1]))
            best[i] = (count, plan)
        segments.extend(best[0][1])
    return segments


def block_segments(backbone):
    """The backbone's segments (see `plan_segments`) as lists of block units."""
    blocks = backbone.get_encoder_blocks()
    boundaries = ()
    if backbone.ensemble_size > 1 and backbone.moe_layers:
        boundaries = (min(backbone.moe_layers),)
    plan = plan_segments([block_signature(b) for b in blocks], boundaries)
    return [[[blocks[i] for i in unit] for unit in segment] for segment in plan]


def scanned_call(backbone, inputs, training=None):
    """The backbone's forward pass with its repeated blocks scanned."""
    replacements = {}
    for segment in block_segments(backbone):
        if len(segment) < 2:
            continue  # one unit: its blocks run as they are
        blocks = [block for unit in segment for block in unit]
        replacements[id(blocks[0])] = (
            lambda x, training, segment=segment: scan_segment(
                segment, x, training, remat=backbone.remat))
        for block in blocks[1:]:
            replacements[id(block)] = lambda x, training: x
    return keras_internals.run_functional_graph(backbone, inputs, training,
                                                replacements)


def scan_segment(units, inputs, training=None, remat=False):
    """Runs `units` (lists of blocks with the same signatures) as one scan.

    Returns the last unit's output `(B, T, D)`; each unit's losses and seed
    states are added and assigned to its own blocks.
    """
    import jax

    template = units[0]
    variables = [[v for block in unit for v in block.variables] for unit in units]
    template_variables = variables[0]
    stacked = [
        keras.ops.stack([stored_value(unit_variables[i]) for unit_variables in variables])
        for i in range(len(template_variables))
    ]
    trace = {}  # filled while the body is traced

    def run_unit(x, scope):
        trace["loss_counts"] = []  # losses after each block
        for block in template:
            x = block._block(keras.ops.cast(x, block.compute_dtype), training)
            trace["loss_counts"].append(len(scope.losses))
        return x

    def unit_call(x, *values):
        return pure_call(template_variables, values, lambda scope: run_unit(x, scope),
                         template, trace)

    if remat:
        unit_call = checkpointed(unit_call)

    def body(x, values):
        results = unit_call(x, *values)
        return results[0], list(results[1:])

    x = keras.ops.cast(inputs, template[0].compute_dtype)
    x, stacked_results = jax.lax.scan(body, x, stacked)
    num_losses = trace["loss_counts"][-1]
    losses, new_values = stacked_results[:num_losses], stacked_results[num_losses:]
    for u, unit in enumerate(units):
        first = 0
        for block, last in zip(unit, trace["loss_counts"], strict=True):
            for loss in losses[first:last]:
                block.add_loss(loss[u])
            first = last
        for i, value in zip(trace["updated"], new_values, strict=True):
            variables[u][i].assign(value[u])
    return x
