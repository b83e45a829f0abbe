"""Checkpoint readers and writers (no jax/flax/tensorflow needed at import)."""

from keras_vmoe.checkpoints.partitioned import MAGIC_KEY
from keras_vmoe.checkpoints.partitioned import MAX_CHUNK_BYTES
from keras_vmoe.checkpoints.partitioned import MAX_SUBCHUNK_BYTES
from keras_vmoe.checkpoints.partitioned import VERSION_V1
from keras_vmoe.checkpoints.partitioned import CheckpointError
from keras_vmoe.checkpoints.partitioned import CheckpointIndex
from keras_vmoe.checkpoints.partitioned import LeafInfo
from keras_vmoe.checkpoints.partitioned import index_path
from keras_vmoe.checkpoints.partitioned import iter_leaves
from keras_vmoe.checkpoints.partitioned import read_index
from keras_vmoe.checkpoints.partitioned import restore_checkpoint
from keras_vmoe.checkpoints.partitioned import restore_flat
from keras_vmoe.checkpoints.partitioned import save_checkpoint
from keras_vmoe.checkpoints.partitioned import shard_path

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
