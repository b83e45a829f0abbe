"""Presets: a catalog of paper models and released checkpoints, and
`from_preset` / `save_to_preset` / `list_presets`.

```python
import keras_vmoe.presets

keras_vmoe.presets.list_presets("vmoe")
model = keras_vmoe.presets.from_preset("vmoe_s32", load_weights=False)
keras_vmoe.presets.save_to_preset(model, "./my_preset")
model = keras_vmoe.presets.from_preset("./my_preset", capacity_factor=2.0)
```
"""

from keras_vmoe.presets.api import CHECKPOINT_ROOT_ENV
from keras_vmoe.presets.api import CONFIG_FILE
from keras_vmoe.presets.api import METADATA_FILE
from keras_vmoe.presets.api import WEIGHTS_FILE
from keras_vmoe.presets.api import PresetWeightsUnavailableError
from keras_vmoe.presets.api import from_preset
from keras_vmoe.presets.api import get_preset_info
from keras_vmoe.presets.api import keras_home
from keras_vmoe.presets.api import list_presets
from keras_vmoe.presets.api import preset_cache_dir
from keras_vmoe.presets.api import resolve_preset_name
from keras_vmoe.presets.api import save_to_preset
from keras_vmoe.presets.catalog import ALIASES
from keras_vmoe.presets.catalog import PRESETS
from keras_vmoe.presets.integrity import PresetIntegrityError

__all__ = [
    "ALIASES",
    "CHECKPOINT_ROOT_ENV",
    "CONFIG_FILE",
    "METADATA_FILE",
    "PRESETS",
    "WEIGHTS_FILE",
    "PresetIntegrityError",
    "PresetWeightsUnavailableError",
    "from_preset",
    "get_preset_info",
    "keras_home",
    "list_presets",
    "preset_cache_dir",
    "resolve_preset_name",
    "save_to_preset",
]
