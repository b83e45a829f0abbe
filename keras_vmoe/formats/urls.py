"""Credentials in URLs, hidden from messages.

A mirror may be given as `https://user:password@host/path` or with a token
in its query (`?token=...`); the messages and log lines that name its URLs
show `***` in their place (`redact`). Standard library only, so that every
reader of checkpoints can use it without loading `http.client`.
"""

from __future__ import annotations

import re

__all__ = ["redact"]

# `scheme://user[:password]@`: everything between `//` and the last `@`
# before the host's end.
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s'\"@]*@")
# Query parameters named like a secret (`?token=`, `&X-Goog-Signature=`, ...).
_SECRET_QUERY = re.compile(
    r"([?&][^=&#\s'\"]*(?:token|key|sig|secret|password|passwd|pwd|auth|credential)"
    r"[^=&#\s'\"]*=)[^&#\s'\"]*",
    re.IGNORECASE,
)


def redact(text):
    """`text` with the credentials of every URL in it replaced by `***`.

    Args:
        text: a URL, or a message naming URLs; anything else is returned
            as it is.

    Returns:
        The text without the `user:password@` part of URLs nor the values
        of query parameters named like secrets.

    Example:

    >>> redact("https://me:s3cret@mirror.example/m/b/o.npz?token=abc&x=1")
    'https://***@mirror.example/m/b/o.npz?token=***&x=1'
    """
    if not isinstance(text, str) or "://" not in text:
        return text
    text = _USERINFO.sub(r"\1***@", text)
    return _SECRET_QUERY.sub(r"\1***", text)
