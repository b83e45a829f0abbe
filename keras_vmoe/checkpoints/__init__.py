"""Deprecated package path: upstream checkpoint formats and conversion.

The readers and writers of upstream files (NumPy and msgpack only) are in
`keras_vmoe.formats`; building Keras models from them is in
`keras_vmoe.conversion`; writing presets in `keras_vmoe.presets.convert`.
`keras_vmoe.checkpoints`, `.partitioned`, `.train_state`, `.vit_npz`,
`.infer` and `.convert` keep working as aliases; no library module imports
them (tests/test_architecture.py). Importing them warns.
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
from keras_vmoe.utils.deprecation import warn_renamed

__all__ = [
    "MAGIC_KEY",
    "MAX_CHUNK_BYTES",
    "MAX_SUBCHUNK_BYTES",
    "VERSION_V1",
    "CheckpointError",
    "CheckpointIndex",
    "LeafInfo",
    "index_path",
    "iter_leaves",
    "read_index",
    "restore_checkpoint",
    "restore_flat",
    "save_checkpoint",
    "shard_path",
]

warn_renamed(__name__, "keras_vmoe.formats and keras_vmoe.conversion", stacklevel=2)
