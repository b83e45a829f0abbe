"""Checkpoint readers and writers (no jax/flax/tensorflow needed at import)."""

from keras_vmoe.checkpoints.partitioned import (
    MAGIC_KEY,
    MAX_CHUNK_BYTES,
    MAX_SUBCHUNK_BYTES,
    VERSION_V1,
    CheckpointError,
    CheckpointIndex,
    LeafInfo,
    index_path,
    iter_leaves,
    read_index,
    restore_checkpoint,
    restore_flat,
    save_checkpoint,
    shard_path,
)

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
