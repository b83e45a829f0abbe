"""Renamed arguments and config keys: one warning, one removal version.

Every deprecated name keeps working until `REMOVAL_VERSION` with a
`DeprecationWarning` that names its replacement; the CHANGELOG lists them
under "Deprecated".
"""

import warnings

# The release that removes what is deprecated now.
REMOVAL_VERSION = "0.4.0"


def warn_renamed(old, new, stacklevel=3):
    """Warns that `old` is deprecated in favour of `new`.

    Args:
        old: the deprecated name, as the user wrote it.
        new: the name to use instead.
        stacklevel: passed to `warnings.warn` (3: the caller's caller).
    """
    warnings.warn(
        f"`{old}` is deprecated and will be removed in keras_vmoe "
        f"{REMOVAL_VERSION}; use `{new}`.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def pop_renamed_argument(kwargs, old, new, value, owner):
    """The value of argument `new`, taking a deprecated `old=` from `kwargs`.

    Args:
        kwargs: the caller's `**kwargs`; `old` is removed from it.
        old: the deprecated keyword.
        new: its current name.
        value: what the caller received as `new` (`None` when not given).
        owner: the class or function, for the messages.

    Returns:
        `value`, or the deprecated keyword's value when only that was given.

    Raises:
        ValueError: both names were given.
    """
    if old not in kwargs:
        return value
    old_value = kwargs.pop(old)
    if value is not None:
        raise ValueError(
            f"{owner}: pass `{new}` only; `{old}` is its deprecated name. "
            f"Received: {new}={value!r}, {old}={old_value!r}")
    warn_renamed(f"{owner}({old}=...)", f"{new}=", stacklevel=4)
    return old_value


def rename_key(config, old, new, where):
    """`config` with key `old` renamed to `new` (a warning when it was there).

    Args:
        config: a dict (not modified).
        old: the deprecated key.
        new: its current name.
        where: what the dict is, for the message (e.g. `"moe"`).

    Returns:
        A new dict.

    Raises:
        ValueError: both keys are present.
    """
    if old not in config:
        return config
    if new in config:
        raise ValueError(
            f"`{where}` has both {new!r} and its deprecated name {old!r}; keep "
            f"{new!r}. Received: {where}={config!r}")
    warn_renamed(f"{where}[{old!r}]", f"{where}[{new!r}]", stacklevel=4)
    config = dict(config)
    config[new] = config.pop(old)
    return config


def call_moved(old, new, *args, **kwargs):
    """Calls the function at path `new` for its deprecated name `old`.

    For a method left where a function moved to a higher layer of the
    package (e.g. an analysis function that left a layer class): the new
    module is imported when the old name is called, not when it is defined.

    Args:
        old: the deprecated name, as the user wrote it.
        new: the function's current dotted path.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        What the function returns.
    """
    import importlib

    warn_renamed(old, new, stacklevel=4)
    module, _, name = new.rpartition(".")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def alias_module(old, new):
    """Makes the deprecated module path `old` the module `new`, with a warning.

    Called as `alias_module(__name__, "keras_vmoe.new.path")` as the only
    statement of a module left at an old path: importing the old path
    warns once and gives the new module itself.

    Args:
        old: the deprecated module's `__name__`.
        new: the module's current path.

    Returns:
        The module `new`.
    """
    import importlib
    import sys

    warn_renamed(old, new, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
