"""Rematerialised layer calls: activations recomputed in the backward pass.

`remat_call` makes a layer call pure (variable values in; outputs, losses and
updated seed states out, under a `keras.StatelessScope`) before `keras.remat`,
so losses are added and seeds advanced once. On JAX's CPU backend, where XLA
merges the recomputation back into the forward pass, `_cpu_remat` is used.
"""

import keras

from keras_vmoe.utils import keras_internals

# NumPy's and OpenVINO's `keras.remat` warns and does nothing.
REMAT_BACKENDS = ("jax", "torch", "tensorflow")


def check_option_backend(option, enabled, backends, needs):
    """Raises a `ValueError` when `option` is on for a backend outside
    `backends`; `needs` completes "`option=True` ..."."""
    backend = keras.config.backend()
    if enabled and backend not in backends:
        raise ValueError(
            f"`{option}=True` {needs}, which the {backend!r} "
            f"backend does not have. Valid backends for {option}: "
            f"{', '.join(backends)} (set KERAS_BACKEND); or use {option}=False."
        )


def check_remat_backend(remat):
    """Raises a `ValueError` when `remat` is asked for on a backend without it."""
    check_option_backend("remat", remat, REMAT_BACKENDS, "needs gradient checkpointing")


def stored_value(variable):
    """The value of `variable` in its own dtype (no mixed-precision cast)."""
    with keras_internals.no_autocast():
        value = keras.ops.convert_to_tensor(variable.value)
    if variable.name == "seed_generator_state":
        # PyTorch updates in place the input its backward pass recomputes from.
        value = keras.ops.copy(value)
    return value


def pure_call(variables, values, run, layers, trace):
    """`run(scope)` in a `StatelessScope` where `variables` hold `values`, as a
    pure function: returns `[outputs, *losses, *updated values]` and records in
    `trace` which variables were updated and how many losses were added."""
    mapping = list(zip(variables, values, strict=True))
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        before = [scope.get_current_value(v) for v in variables]
        outputs = run(scope)
        losses = list(scope.losses)
        for layer in layers:
            keras_internals.forget_sublayer_losses(layer)
    trace["updated"] = [
        i for i, (v, old) in enumerate(zip(variables, before, strict=True))
        if scope.get_current_value(v) is not old
    ]
    trace["num_losses"] = len(losses)
    new_values = [scope.get_current_value(variables[i]) for i in trace["updated"]]
    return [outputs, *losses, *new_values]


def remat_call(layer, call, inputs, **kwargs):
    """`call(inputs, **kwargs)`, recomputed in the backward pass.

    `call` runs `layer`'s sublayers and uses only `layer.variables`; its
    losses are added once by `layer` and its seed updates applied once.
    """
    variables = list(layer.variables)
    values = [stored_value(v) for v in variables]
    trace = {}

    def pure(inputs, *values):
        return pure_call(variables, values, lambda scope: call(inputs, **kwargs),
                         [layer], trace)

    results = checkpointed(pure)(inputs, *values)
    outputs = results[0]
    losses = results[1 : 1 + trace["num_losses"]]
    new_values = results[1 + trace["num_losses"] :]
    for index, value in zip(trace["updated"], new_values, strict=True):
        variables[index].assign(value)
    for loss in losses:
        layer.add_loss(loss)
    return outputs


def checkpointed(function):
    """`function` recomputed in the backward pass, on this backend."""
    if keras.config.backend() == "jax":
        import jax

        if jax.default_backend() == "cpu":
            return _cpu_remat(function)
    return keras.remat(function)


def _cpu_remat(function):
    """`function` (arrays -> list, first item float) with a backward pass
    that recomputes it, on JAX's XLA:CPU."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def remat(*args):
        return function(*args)

    def forward(*args):
        return function(*args), args  # only the inputs are kept

    def backward(args, cotangents):
        def gradients(operands):
            args, cotangents = operands
            _, vjp = jax.vjp(function, *args)
            return vjp(cotangents)

        # A predicate XLA cannot fold: the recomputation waits for the
        # cotangent, and no pass merges it with the forward pass.
        first = cotangents[0]
        ready = jnp.isfinite(jnp.reshape(first, (-1,))[0])
        return jax.lax.cond(ready, gradients, gradients, (args, cotangents))

    remat.defvjp(forward, backward)
    return remat
