"""Data, expert and model parallelism for V-MoE through `keras.distribution`.

```python
# 8 devices; on a CPU, set this before JAX starts:
#   XLA_FLAGS=--xla_force_host_platform_device_count=8
import keras_vmoe  # before keras: without KERAS_BACKEND, it picks JAX
import keras
from keras_vmoe import distribution

config = keras_vmoe.models.backbone_config(   # a tiny V-MoE, 8 experts
    "vmoe", "S/32", image_size=32, patch_size=16, hidden_dim=32,
    num_heads=2, mlp_dim=64, num_layers=2, layout="every2", num_experts=8,
    images_per_group=1)   # 64 token groups: a multiple of the 8 devices
mesh = distribution.make_mesh(data=2, expert=4)
dist = distribution.make_distribution("expert", mesh, config=config,
                                      batch_size=64)     # checked up front
keras.distribution.set_distribution(dist)
# Build after set_distribution: the expert weights are sharded over `expert`.
backbone = keras_vmoe.models.VisionTransformerBackbone(**config)
keras.distribution.set_distribution(None)
```

Layouts: `"data"`, `"expert"`, `"expert_model"` and `"pod"` (see `layouts`).
"""

from keras_vmoe.utils.lazy import lazy_exports

_LAYOUTS = "keras_vmoe.distribution.layouts"
# Imported on first use: `launch` and the command line stay free of Keras and JAX.
_EXPORTS = {
    "LAYOUTS": _LAYOUTS,
    "MESH_AXES": _LAYOUTS,
    "ModelParallel": _LAYOUTS,
    "MultiAxisLayout": _LAYOUTS,
    "check_divisible": "keras_vmoe.distribution.validation",
    "initialize": "keras_vmoe.distribution.launch",
    "layout_map": _LAYOUTS,
    "make_distribution": _LAYOUTS,
    "make_mesh": _LAYOUTS,
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
