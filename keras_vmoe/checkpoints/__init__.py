"""Deprecated package path: upstream checkpoint formats and conversion.

The readers and writers of upstream files (NumPy and msgpack only) are in
`keras_vmoe.formats`; building Keras models from them is in
`keras_vmoe.conversion`; writing presets in `keras_vmoe.presets.convert`.
`keras_vmoe.checkpoints`, `.partitioned`, `.train_state`, `.vit_npz`,
`.infer` and `.convert` keep working as aliases; no library module imports
them (tests/test_architecture.py). Importing them warns.
"""


from keras_vmoe._lazy import deprecated_exports
from keras_vmoe.formats import MOVED_NAMES
from keras_vmoe.formats.partitioned import CheckpointError
from keras_vmoe.formats.partitioned import CheckpointIndex
from keras_vmoe.formats.partitioned import read_index
from keras_vmoe.formats.partitioned import restore_checkpoint
from keras_vmoe.formats.partitioned import save_checkpoint
from keras_vmoe.utils.deprecation import warn_renamed

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "read_index",
    "restore_checkpoint",
    "save_checkpoint",
]

# The partitioned format's constants and helpers, which this package also
# exported: reaching them here warns (once more) with their module's path.
__getattr__ = deprecated_exports(
    __name__, {name: module for name, module in MOVED_NAMES.items()
               if module == "keras_vmoe.formats.partitioned"})

warn_renamed(__name__, "keras_vmoe.formats and keras_vmoe.conversion", stacklevel=2)
