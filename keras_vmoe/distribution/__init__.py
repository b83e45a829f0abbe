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

Layouts: `"data"`, `"expert"` (upstream's: experts over `expert`, batch
over `data` x `expert`, all-to-all dispatch), `"expert_model"` (+ heads and
MLP hidden units over `model`) and `"pod"` (+ every weight and optimizer
slot over `data`). `memory_plan` reports per-device memory of a layout from
XLA's compiled memory analysis; `launch`/`initialize` run the same code as
several processes.
"""

from keras_vmoe._lazy import lazy_exports

# name -> module that defines it (imported on first use: `keras_vmoe.distribution.launch`
# and the command line stay free of Keras and JAX).
_EXPORTS = {
    "EXPERT_WEIGHT_PATTERNS": "keras_vmoe.distribution.compat",
    "LAYOUTS": "keras_vmoe.distribution.layouts",
    "MESH_AXES": "keras_vmoe.distribution.layouts",
    "ModelParallel": "keras_vmoe.distribution.layouts",
    "MultiAxisLayout": "keras_vmoe.distribution.layouts",
    "check_divisible": "keras_vmoe.distribution.validation",
    "check_expert_sharding": "keras_vmoe.distribution.compat",
    "data_parallel": "keras_vmoe.distribution.layouts",
    "device_mesh": "keras_vmoe.distribution.compat",
    "expert_model_parallel": "keras_vmoe.distribution.layouts",
    "expert_parallel": "keras_vmoe.distribution.compat",
    "expert_parallel_distribution": "keras_vmoe.distribution.layouts",
    "expert_parallel_layout_map": "keras_vmoe.distribution.compat",
    "initialize": "keras_vmoe.distribution.launch",
    "layout_map": "keras_vmoe.distribution.layouts",
    "make_distribution": "keras_vmoe.distribution.layouts",
    "make_mesh": "keras_vmoe.distribution.layouts",
    "memory_plan": "keras_vmoe.distribution.plan",
    "pod_parallel": "keras_vmoe.distribution.layouts",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
