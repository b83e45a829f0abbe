"""Dropout applied only when it can drop anything."""


def apply_dropout(dropout, x, training):
    """`dropout(x, training=training)`, or `x` itself when that is the result.

    At inference (`training` false or `None`) or with `rate == 0` a Keras
    `Dropout` returns its input unchanged and draws no random numbers, so
    skipping the call gives the same values and the same random stream.
    It saves the layer call itself, which JAX and TensorFlow trace away but
    an eager PyTorch forward pays every time.

    Args:
        dropout: a `keras.layers.Dropout`.
        x: its input tensor.
        training: the caller's `training` flag.

    Returns:
        The tensor after dropout.
    """
    if not training or dropout.rate == 0:
        return x
    return dropout(x, training=training)
