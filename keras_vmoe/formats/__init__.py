"""Readers and writers of upstream file formats: NumPy, msgpack, no Keras.

* `partitioned`: vmoe's "partitioned" checkpoints (`.index` + `.data-*`).
* `train_state`: whole train states of the upstream trainer (Orbax
  directories, `workdir/ckpt_<step>` prefixes); their parameter subtree.
* `vit_npz`: google-research/vision_transformer `.npz` files.
* `upstream`: any of those (or an in-memory dict) as `(path, array)` pairs.

Nothing here imports Keras, JAX or the rest of keras_vmoe except
`keras_vmoe.utils.memory_budget` (tests/test_architecture.py checks it).
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
