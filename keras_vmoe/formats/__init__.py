"""Readers and writers of upstream file formats: NumPy, msgpack, no Keras.

* `partitioned`: vmoe's "partitioned" checkpoints (`.index` + `.data-*`).
* `train_state`: whole train states of the upstream trainer (Orbax
  directories, `workdir/ckpt_<step>` prefixes); their parameter subtree.
* `vit_npz`: google-research/vision_transformer `.npz` files.
* `upstream`: any of those (or an in-memory dict) as `(path, array)` pairs.

Nothing here imports Keras, JAX or the rest of keras_vmoe except
`keras_vmoe.memory_budget` (tests/test_architecture.py checks it).
"""

from keras_vmoe._lazy import deprecated_exports
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

# Names that left this package's face: they live in their modules, and
# reaching them here warns until 0.4.0.
MOVED_NAMES = {
    "MAGIC_KEY": "keras_vmoe.formats.partitioned",
    "MAX_CHUNK_BYTES": "keras_vmoe.formats.partitioned",
    "MAX_SUBCHUNK_BYTES": "keras_vmoe.formats.partitioned",
    "VERSION_V1": "keras_vmoe.formats.partitioned",
    "LeafInfo": "keras_vmoe.formats.partitioned",
    "index_path": "keras_vmoe.formats.partitioned",
    "iter_leaves": "keras_vmoe.formats.partitioned",
    "resolve_upstream": "keras_vmoe.formats.upstream",
    "restore_flat": "keras_vmoe.formats.partitioned",
    "shard_path": "keras_vmoe.formats.partitioned",
}
__getattr__ = deprecated_exports(__name__, MOVED_NAMES)
