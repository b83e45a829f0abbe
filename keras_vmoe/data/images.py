"""Image files: a cheap check of each file (Pillow), and reading one as uint8 RGB."""

from __future__ import annotations

import os
import sys

import numpy as np

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
# Formats the tf.data pipelines decode (`tf.io.decode_image`).
PIPELINE_FORMATS = ("JPEG", "PNG", "BMP", "GIF")
# 2**28 pixels (16k x 16k): larger images are refused before decoding (a
# 30000 x 30000 PNG would need 2.7 GB as uint8 RGB).
MAX_PIXELS = 1 << 28


class UnreadableImageError(ValueError):
    """An image file that cannot be used; the message names the file."""

    def __init__(self, path, reason):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


def inspect_image(path, formats=None, decode=False):
    """Why `path` is not a usable image (a short str), or None when it is.

    Reads the header and the end of the file: not an image, a format not in
    `formats` (Pillow names; None: any), a decompression bomb, a truncated
    JPEG or PNG; a corrupt body only with `decode=True` (a full decode).
    """
    from PIL import Image

    try:
        if os.path.getsize(path) == 0:
            return "empty file"
        with Image.open(path) as image:
            kind = image.format
            width, height = image.size
            if formats is not None and kind not in formats:
                return (f"{kind} images are not supported here (supported: "
                        f"{', '.join(formats)})")
            if width * height > MAX_PIXELS:
                return (f"declares {width}x{height} = {width * height} pixels, more "
                        f"than the limit of {MAX_PIXELS} pixels")
            with open(path, "rb") as f:  # the last 1024 bytes
                f.seek(max(0, f.seek(0, os.SEEK_END) - 1024))
                tail = f.read()
            if kind == "JPEG" and b"\xff\xd9" not in tail:
                return "truncated JPEG (no end-of-image marker)"
            if kind == "PNG" and b"IEND" not in tail:
                return "truncated PNG (no IEND chunk)"
            if decode:
                image.load()
    except Image.DecompressionBombError as error:
        return f"too large to decode safely: {error}"
    except (OSError, SyntaxError, ValueError) as error:
        # Pillow: UnidentifiedImageError (an OSError) for non-images,
        # OSError/SyntaxError for damaged files.
        message = str(error).replace(os.fspath(path), "").strip(" :'\"") or type(
            error).__name__
        return f"not a readable image ({message})"
    return None


def to_rgb_uint8(image):
    """A PIL image as uint8 RGB `(H, W, 3)`, EXIF orientation applied.

    16- or 32-bit grayscale keeps its high byte, as `tf.io.decode_image` does
    (PIL's own conversion clips it, turning most pixels white).
    """
    from PIL import ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        values = np.clip(np.asarray(image).astype("int64"), 0, 2**32 - 1)
        shift = 8 if values.max(initial=0) <= 65535 else 24
        gray = (values >> shift).astype("uint8")
        return np.repeat(gray[..., None], 3, axis=-1)
    return np.asarray(image.convert("RGB"))


def read_image(path):
    """An image file as uint8 RGB `(H, W, 3)`.

    Raises:
        UnreadableImageError: naming the file and the reason.
    """
    from PIL import Image

    reason = inspect_image(path)
    if reason is not None:
        raise UnreadableImageError(path, reason)
    try:
        with Image.open(path) as image:
            image = to_rgb_uint8(image)
    except (OSError, SyntaxError, ValueError) as error:
        raise UnreadableImageError(path, f"not a readable image ({error})") from None
    return image


def warn_skipped(path, reason):
    print(f"warning: skipping {path}: {reason}", file=sys.stderr, flush=True)
