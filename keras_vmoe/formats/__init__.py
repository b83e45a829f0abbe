"""Readers and writers of upstream file formats: NumPy, msgpack, no Keras.

* `partitioned`: vmoe's "partitioned" checkpoints (`.index` + `.data-*`).
* `train_state`: whole train states of the upstream trainer (Orbax
  directories, `workdir/ckpt_<step>` prefixes); their parameter subtree.
* `vit_npz`: google-research/vision_transformer `.npz` files.
* `upstream`: any of those (or an in-memory dict) as `(path, array)` pairs.

Nothing here imports Keras, JAX or the rest of keras_vmoe except
`keras_vmoe.budget` (tests/test_architecture.py checks it).
"""

from keras_vmoe.formats.partitioned import MAGIC_KEY
from keras_vmoe.formats.partitioned import MAX_CHUNK_BYTES
from keras_vmoe.formats.partitioned import MAX_SUBCHUNK_BYTES
from keras_vmoe.formats.partitioned import VERSION_V1
from keras_vmoe.formats.partitioned import CheckpointError
from keras_vmoe.formats.partitioned import CheckpointIndex
from keras_vmoe.formats.partitioned import LeafInfo
from keras_vmoe.formats.partitioned import index_path
from keras_vmoe.formats.partitioned import iter_leaves
from keras_vmoe.formats.partitioned import read_index
from keras_vmoe.formats.partitioned import restore_checkpoint
from keras_vmoe.formats.partitioned import restore_flat
from keras_vmoe.formats.partitioned import save_checkpoint
from keras_vmoe.formats.partitioned import shard_path
from keras_vmoe.formats.upstream import iter_upstream_params
from keras_vmoe.formats.upstream import load_upstream_params
from keras_vmoe.formats.upstream import read_upstream_shapes
from keras_vmoe.formats.upstream import resolve_upstream

__all__ = [
    "MAGIC_KEY",
    "MAX_CHUNK_BYTES",
    "MAX_SUBCHUNK_BYTES",
    "VERSION_V1",
    "CheckpointError",
    "CheckpointIndex",
    "LeafInfo",
    "index_path",
    "iter_upstream_params",
    "iter_leaves",
    "load_upstream_params",
    "read_index",
    "read_upstream_shapes",
    "resolve_upstream",
    "restore_checkpoint",
    "restore_flat",
    "save_checkpoint",
    "shard_path",
]
