"""Memory budget: refuse models and arrays larger than this machine.

`check_fits` raises `MemoryBudgetError` before an allocation larger than
`memory_limit()`; `KERAS_VMOE_ALLOW_LARGE_MODELS=1` turns the check off.
"""

import math
import os

from keras_vmoe.utils.keras_internals import stateless_scope

ALLOW_ENV = "KERAS_VMOE_ALLOW_LARGE_MODELS"


class MemoryBudgetError(ValueError):
    """A model or array needs more memory than this machine has."""


def format_bytes(count):
    """`"19200000000 bytes (19.2 GB)"` style text of a byte count."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= scale:
            return f"{count} bytes ({count / scale:.1f} {unit})"
    return f"{count} bytes"


def memory_limit():
    """Bytes this process can allocate at most: RAM, or RLIMIT_AS if lower."""
    limit = math.inf
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
            limit = min(limit, soft)
    except (ImportError, ValueError, OSError):  # pragma: no cover
        pass
    return limit


def in_abstract_build():
    """Whether variables are created without values (`abstract_weights()`)."""
    scope = stateless_scope()
    return scope is not None and not getattr(scope, "initialize_variables", True)


def large_allowed():
    """Whether `KERAS_VMOE_ALLOW_LARGE_MODELS` turns the check off."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")


def check_fits(nbytes, what, detail=""):
    """Raises `MemoryBudgetError` if `nbytes` exceed `memory_limit()`; `what`
    needs them, `detail` names the settings responsible."""
    if large_allowed():
        return
    limit = memory_limit()
    if nbytes > limit:
        raise MemoryBudgetError(
            f"{what} needs at least {format_bytes(int(nbytes))}, more than this "
            f"machine's memory ({format_bytes(int(limit))})"
            + (f": {detail}" if detail else "")
            + f". Nothing was allocated. If you mean it, set {ALLOW_ENV}=1."
        )
