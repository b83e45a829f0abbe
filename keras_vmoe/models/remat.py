"""Rematerialised layer calls: activations recomputed in the backward pass.

`keras.remat` wraps a *function* in the backend's gradient checkpointing
(`jax.checkpoint`, `tf.recompute_grad`, non-reentrant
`torch.utils.checkpoint`). Keras' own `RematScope` wraps a layer's `call`
as it is, and an encoder block's `call` is not a function: it reads
variables, advances seed generators (dropout, router noise) and calls
`add_loss` (the MoE auxiliary losses). Inside a checkpointed function
those side effects go wrong: on JAX the losses and the new seed states are
values of the inner trace that leak out of it; on PyTorch and TensorFlow
the backward pass runs `call` again, so the losses are added a second time
and the seeds advance again (the recomputed dropout masks differ from the
forward ones, and so do the gradients).

`remat_call` therefore makes the call pure before handing it to
`keras.remat`: the values of all the layer's variables go in, and the
outputs, the losses and the updated non-trainable values (seed states) come
out, under a `keras.StatelessScope`. After the checkpointed function
returns, the updates are assigned and the losses added from the layer,
once. The same code then serves the three backends, and `keras.remat` (the
backend's own checkpointing, saving nothing inside the call) does the job
on PyTorch, TensorFlow and JAX on GPU and TPU.

It does not on JAX's CPU backend: `jax.checkpoint` keeps the recomputation
apart from the forward pass with optimization barriers, which XLA:CPU
removes; its common-subexpression pass then merges the recomputation back
into the forward pass, and every activation is kept as without remat (the
compiled program has the same matrix products and the same temporaries).
On CPU, `_cpu_remat` therefore recomputes inside a `lax.cond` whose
predicate reads the incoming cotangent: XLA cannot merge it with the
forward pass, and it runs when the block's backward pass starts. Both
branches are the same recomputation. (A conditional is not used on GPU,
where its predicate is read by the host.) `keras-vmoe plan` compiles on
CPU to estimate accelerator memory, which is why the CPU program must
rematerialise too. `check_remat_backend` refuses the backends whose
`keras.remat` silently does nothing (NumPy, OpenVINO).
"""

import keras

from keras_vmoe.utils import keras_internals

# Backends whose `keras.remat` recomputes in the backward pass (NumPy and
# OpenVINO have no gradients; their `keras.remat` warns and does nothing).
REMAT_BACKENDS = ("jax", "torch", "tensorflow")


def check_option_backend(option, enabled, backends, needs):
    """Raises a `ValueError` when a backbone option is on for a backend
    outside `backends`.

    Args:
        option: str, the option's name (`"remat"`, `"scan"`).
        enabled: bool, its value.
        backends: the backends that have it.
        needs: str, what the option needs, completing "`option=True` ...".
    """
    backend = keras.config.backend()
    if enabled and backend not in backends:
        raise ValueError(
            f"`{option}=True` {needs}, which the {backend!r} "
            f"backend does not have. Valid backends for {option}: "
            f"{', '.join(backends)} (set KERAS_BACKEND); or use {option}=False."
        )


def check_remat_backend(remat):
    """Raises a `ValueError` when `remat` is asked for on a backend without it.

    Args:
        remat: bool, the `remat` option.
    """
    check_option_backend("remat", remat, REMAT_BACKENDS, "needs gradient checkpointing")


def stored_value(variable):
    """The value of `variable` in its own dtype (no mixed-precision cast).

    Seed-generator states are copied: the call updates them after the
    checkpointed function returned, and PyTorch updates a variable in place,
    which would change the input its backward pass recomputes from.
    """
    with keras_internals.no_autocast():
        value = keras.ops.convert_to_tensor(variable.value)
    if variable.name == "seed_generator_state":
        value = keras.ops.copy(value)
    return value


def remat_call(layer, call, inputs, **kwargs):
    """`call(inputs, **kwargs)`, recomputed in the backward pass.

    `call` runs `layer`'s sublayers (it must not `add_loss` on `layer`
    itself) and every
    variable it reads or updates must be one of `layer.variables`. Its
    `add_loss` losses end up added once by `layer`, and its seed-generator
    updates are applied once, as without remat.

    Args:
        layer: the `keras.layers.Layer` whose variables `call` uses.
        call: callable `(inputs, **kwargs) -> tensor`.
        inputs: tensor, the only differentiable input besides the variables.
        **kwargs: further arguments of `call` (Python values: `training`).

    Returns:
        The output tensor of `call`.
    """
    variables = list(layer.variables)
    values = [stored_value(v) for v in variables]
    # Filled while `pure` runs: which variables it updated, and how many
    # losses it added (fixed for the layer and its arguments).
    trace = {}

    def pure(inputs, *values):
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            before = [scope.get_current_value(v) for v in variables]
            outputs = call(inputs, **kwargs)
            losses = list(scope.losses)
            keras_internals.forget_sublayer_losses(layer)
        updated = [
            i for i, (v, old) in enumerate(zip(variables, before, strict=True))
            if scope.get_current_value(v) is not old
        ]
        trace["updated"] = updated
        trace["num_losses"] = len(losses)
        new_values = [scope.get_current_value(variables[i]) for i in updated]
        return [outputs, *losses, *new_values]

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
    """`function` with a backward pass that recomputes it (JAX on XLA:CPU).

    `function` takes arrays and returns a list of arrays whose first item is
    floating point.
    """
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
