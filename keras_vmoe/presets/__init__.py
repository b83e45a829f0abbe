"""Presets: a catalog of paper models and released checkpoints, and
`from_preset` / `save_to_preset` / `list_presets`, and `upcycle` (a dense
ViT model, preset or `.npz` made into an MoE).

```python
import keras_vmoe.presets

keras_vmoe.presets.list_presets("vmoe")
model = keras_vmoe.presets.from_preset(
    "vmoe_s32", load_weights=False, num_layers=4, num_experts=4)
keras_vmoe.presets.save_to_preset(model, "./my_preset")
model = keras_vmoe.presets.from_preset("./my_preset", capacity_factor=2.0)
```

The names are imported lazily: listing and looking up presets does not
import Keras.
"""

from keras_vmoe.utils.lazy import lazy_exports

# name -> module that defines it.
_EXPORTS = {
    "keras_home": "keras_vmoe.catalog.names",
    "preset_cache_dir": "keras_vmoe.catalog.names",
    "resolve_preset_name": "keras_vmoe.catalog.names",
    "list_presets": "keras_vmoe.presets.table",
    "save_to_preset": "keras_vmoe.presets.save",
    "PresetWeightsUnavailableError": "keras_vmoe.presets.released",
    "from_preset": "keras_vmoe.presets.load",
    "get_preset_info": "keras_vmoe.presets.load",
    "convert_to_preset": "keras_vmoe.presets.convert",
    "convert_vit_npz_to_preset": "keras_vmoe.presets.convert",
    "PresetIntegrityError": "keras_vmoe.presets.integrity",
    "upcycle": "keras_vmoe.presets.upcycling",
    "upload_preset": "keras_vmoe.presets.upload",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
