"""Data, expert and model parallelism for V-MoE through `keras.distribution`.

```python
# 8 devices; on a CPU, set this before JAX starts:
#   XLA_FLAGS=--xla_force_host_platform_device_count=8
import keras
import keras_vmoe
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

from keras_vmoe.distribution.compat import EXPERT_WEIGHT_PATTERNS
from keras_vmoe.distribution.compat import check_expert_sharding
from keras_vmoe.distribution.compat import device_mesh
from keras_vmoe.distribution.compat import expert_parallel
from keras_vmoe.distribution.compat import expert_parallel_layout_map
from keras_vmoe.distribution.layouts import LAYOUTS
from keras_vmoe.distribution.layouts import MESH_AXES
from keras_vmoe.distribution.layouts import ModelParallel
from keras_vmoe.distribution.layouts import MultiAxisLayout
from keras_vmoe.distribution.layouts import data_parallel
from keras_vmoe.distribution.layouts import expert_model_parallel
from keras_vmoe.distribution.layouts import expert_parallel_distribution
from keras_vmoe.distribution.layouts import layout_map
from keras_vmoe.distribution.layouts import make_distribution
from keras_vmoe.distribution.layouts import make_mesh
from keras_vmoe.distribution.layouts import pod_parallel
from keras_vmoe.distribution.validation import check_divisible


def memory_plan(*args, **kwargs):
    """See `keras_vmoe.distribution.plan.memory_plan`."""
    from keras_vmoe.distribution.plan import memory_plan as plan

    return plan(*args, **kwargs)


def initialize(*args, **kwargs):
    """See `keras_vmoe.distribution.launch.initialize`."""
    from keras_vmoe.distribution.launch import initialize as init

    return init(*args, **kwargs)


__all__ = [
    "EXPERT_WEIGHT_PATTERNS",
    "LAYOUTS",
    "MESH_AXES",
    "ModelParallel",
    "MultiAxisLayout",
    "check_divisible",
    "check_expert_sharding",
    "data_parallel",
    "device_mesh",
    "expert_model_parallel",
    "expert_parallel",
    "expert_parallel_distribution",
    "expert_parallel_layout_map",
    "initialize",
    "layout_map",
    "make_distribution",
    "make_mesh",
    "memory_plan",
    "pod_parallel",
]
