"""Storing a preset's float weights in a smaller dtype (`save_to_preset(...,
dtype="bfloat16")`); loading casts them back. Integer state is kept as is.
"""

import h5py
import ml_dtypes
import numpy as np

STORAGE_DTYPES = ("float32", "bfloat16", "float16")
_NUMPY_DTYPES = {
    "float32": np.dtype("float32"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype("float16"),
}
# Keras' H5 store marks bfloat16 datasets with this attribute.
_DTYPE_ATTR = "dtype"


def validate_storage_dtype(dtype):
    """`None` or one of `STORAGE_DTYPES`, else a `ValueError` naming them."""
    if dtype is None:
        return None
    name = getattr(dtype, "name", dtype)
    if name not in STORAGE_DTYPES:
        raise ValueError(
            f"`dtype` must be None (keep the model's dtypes) or one of "
            f"{list(STORAGE_DTYPES)}. Received: dtype={dtype!r}")
    return name


def cast_weights_file(src, dst, dtype):
    """Copies the `.weights.h5` file `src` to `dst`, float weights cast to `dtype`."""
    target = _NUMPY_DTYPES[validate_storage_dtype(dtype)]
    with h5py.File(src, "r") as source, h5py.File(dst, "w") as out:
        out.attrs.update(source.attrs)

        def copy(name, item):
            if isinstance(item, h5py.Group):
                out.require_group(name).attrs.update(item.attrs)
                return
            attrs = dict(item.attrs)
            bfloat16 = attrs.get(_DTYPE_ATTR) == "bfloat16"
            if not (bfloat16 or np.issubdtype(item.dtype, np.floating)):
                out.create_dataset(name, data=item[()])
            else:
                value = np.asarray(item[()])
                if bfloat16:
                    value = value.view(ml_dtypes.bfloat16)
                out.create_dataset(name, data=value.astype(target))
                attrs.pop(_DTYPE_ATTR, None)
                if target == _NUMPY_DTYPES["bfloat16"]:
                    attrs[_DTYPE_ATTR] = "bfloat16"
            out[name].attrs.update(attrs)

        source.visititems(copy)
