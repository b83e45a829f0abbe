"""Dropout applied only when it can drop anything."""


def apply_dropout(dropout, x, training):
    """`dropout(x, training=training)`, skipped when it would return `x`.

    Same values and random stream; saves the call in eager PyTorch.
    """
    if not training or dropout.rate == 0:
        return x
    return dropout(x, training=training)
