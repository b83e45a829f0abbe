"""Readers and writers of upstream file formats: NumPy, msgpack, no Keras.

vmoe's partitioned checkpoints (`partitioned`), upstream train states
(`train_state`), vision_transformer `.npz` files (`vit_npz`), and any of them
as `(path, array)` pairs (`upstream`). Nothing here imports Keras (JAX only
lazily, for Orbax).
"""

from keras_vmoe.formats.partitioned import CheckpointError
from keras_vmoe.formats.partitioned import CheckpointIndex
from keras_vmoe.formats.partitioned import read_index
from keras_vmoe.formats.partitioned import restore_checkpoint
from keras_vmoe.formats.partitioned import save_checkpoint
from keras_vmoe.formats.upstream import iter_upstream_params
from keras_vmoe.formats.upstream import load_upstream_params
from keras_vmoe.formats.upstream import read_upstream_shapes

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "iter_upstream_params",
    "load_upstream_params",
    "read_index",
    "read_upstream_shapes",
    "restore_checkpoint",
    "save_checkpoint",
]
