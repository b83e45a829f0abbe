"""Keeps a model usable after `fit`/`evaluate`/`predict` raise (JAX backend).

Keras' JAX trainer detaches the model's variable values while it loops over
batches (`_purge_model_variables`) and reattaches them only at the end of a
successful `predict`/`evaluate` (`jax_state_sync`). When a batch raises
(e.g. images of the wrong size, or a last partial batch that a fixed MoE
`group_size` does not divide) the variables stay detached and every later
call fails with `TypeError: 'NoneType' object is not callable`. `restore_on_error`
restores them before re-raising, so that the user sees the real error
once and can retry with valid inputs.

Still needed with Keras 3.15.1: its JAX `predict` and `evaluate` have no
`try`/`finally` around the batch loop (`fit` has one). The Keras attributes
used are wrapped in `keras_vmoe.utils.keras_internals`;
`tests/utils/test_keras_internals.py` fails when Keras changes them or fixes the
bug (then delete this guard).

The same wrapper makes the default progress output (`verbose="auto"`)
plain when stdout is not a terminal (a pipe, a log file): Keras' progress
bar writes colour escapes and backspaces there, so one plain line per
epoch (`verbose=2`) is printed instead (`plain_progress`).
"""

import functools
import inspect
import os
import sys

import keras

from keras_vmoe.utils import keras_internals
from keras_vmoe.utils.validation import check_int


def _all_variables(model):
    variables = list(model.variables)
    variables += list(getattr(model, "metrics_variables", []))
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    seen, unique = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    return unique


def restore_on_error(method):
    """Wraps `fit`/`evaluate`/`predict`: on an error, reattaches the model's
    variables (JAX) before re-raising."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        args, kwargs = plain_progress(method.__name__, args, kwargs)
        if keras.backend.backend() != "jax":
            return method(self, *args, **kwargs)
        saved = [
            (v, keras_internals.variable_value(v)) for v in _all_variables(self)
        ]
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            # Values of the last successful batch, if any, then the values
            # from before the call for whatever is still detached.
            if keras_internals.has_pending_jax_state(self):
                try:
                    keras_internals.sync_jax_state(self)
                except Exception:  # pragma: no cover - best effort
                    pass
            for variable, value in saved:
                if keras_internals.variable_value(variable) is None and value is not None:
                    keras_internals.reattach_value(variable, value)
            keras_internals.clear_jax_state(self)
            raise

    return wrapper


def _terminal():
    """Whether stdout shows Keras' progress bar as a bar (Keras' own test)."""
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        tty = bool(isatty and isatty())
    except ValueError:  # a closed stream
        tty = False
    return tty or "ipykernel" in sys.modules or "PYCHARM_HOSTED" in os.environ


def plain_progress(method_name, args, kwargs):
    """`(args, kwargs)` of `fit`/`evaluate`/`predict` with `verbose="auto"`
    made `2` (one plain line per epoch) when stdout is not a terminal.

    An explicit `verbose` (0, 1 or 2) is left as it is.
    """
    if _terminal():
        return args, kwargs
    names = list(inspect.signature(getattr(keras.Model, method_name)).parameters)[1:]
    position = names.index("verbose")
    if len(args) > position:
        if isinstance(args[position], str) and args[position] == "auto":
            args = (*args[:position], 2, *args[position + 1:])
        return args, kwargs
    if kwargs.get("verbose", "auto") == "auto":
        kwargs = {**kwargs, "verbose": 2}
    return args, kwargs


def check_data_arguments(method_name, args, kwargs):
    """Refuses what Keras' loops do not handle with a clear message: an
    in-memory `x` with 0 examples (an empty array or list: Keras raises
    `UnboundLocalError` or `KeyError` deep inside `predict`), and a
    `batch_size` that is not a whole number >= 1 (Keras runs `0` and
    `True`, and fails on `2.5` or `"4"` with a `TypeError`)."""
    x = args[0] if args else kwargs.get("x")
    if isinstance(x, (list, tuple)) and not x:
        raise ValueError(
            f"`{method_name}` received no images: x is an empty "
            f"{type(x).__name__}. Pass at least one image.")
    first = next(iter(x.values()), None) if isinstance(x, dict) else x
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] == 0:
        raise ValueError(
            f"`{method_name}` received an empty batch: x has batch size 0 "
            f"(shape {tuple(shape)}). Pass at least one image."
        )
    position = 2 if method_name in ("fit", "evaluate") else 1
    batch_size = args[position] if len(args) > position else kwargs.get("batch_size")
    if batch_size is not None:
        check_int(batch_size, "batch_size")


def pad_last_batch(args, kwargs):
    """Pads an in-memory `predict` input to whole batches under a distribution.

    With a `keras.distribution` set, every batch is split over the devices
    of the batch axes, so a partial last batch (20 images in batches of 16)
    fails with JAX's `IndivisibleError`. The input is padded with zero
    images to a multiple of the batch size; the caller drops their outputs.
    With one token group per image (the layouts' default) the padding does
    not change the other images' outputs.

    Returns:
        `(args, kwargs, count)` with `x` padded and `count` the number of
        real examples, or None when nothing needs padding.
    """
    import numpy as np

    if keras.distribution.distribution() is None:
        return None
    args, kwargs = list(args), dict(kwargs)
    x = args[0] if args else kwargs.get("x")
    if not isinstance(x, np.ndarray) or x.ndim == 0:
        return None
    batch_size = kwargs.get("batch_size") or (args[1] if len(args) > 1 else None) or 32
    count = len(x)
    missing = -count % batch_size
    if not missing:
        return None
    padded = np.concatenate([x, np.zeros((missing, *x.shape[1:]), x.dtype)])
    if args:
        args[0] = padded
    else:
        kwargs["x"] = padded
    return tuple(args), kwargs, count


def predict_whole_batches(predict, args, kwargs):
    """Calls Keras' `predict` on `x` padded to whole batches (`pad_last_batch`).

    Args:
        predict: the bound `keras.Model.predict` to call.
        args: its positional arguments.
        kwargs: its keyword arguments.

    Returns:
        `predict`'s outputs for the real examples only.
    """
    padded = pad_last_batch(list(args), kwargs)
    if padded is None:
        return predict(*args, **kwargs)
    args, kwargs, count = padded
    outputs = predict(*args, **kwargs)
    return keras.tree.map_structure(lambda array: array[:count], outputs)
