"""`Backbone`: the base class of keras_vmoe backbones (images -> features):
presets, LoRA, int8 quantization, layout maps and error-safe
`fit`/`evaluate`/`predict`.
"""

from keras_vmoe.distribution.layouts import layout_map
from keras_vmoe.distribution.validation import check_divisible
from keras_vmoe.models import state_guard
from keras_vmoe.models.model_base import ModelBase
from keras_vmoe.utils import initialization

# `.keras` files of keras_vmoe models load without drawing the weights they hold.
initialization.skip_initializers_in_keras_files()


class Backbone(ModelBase):
    """Base class of the keras_vmoe backbones (images -> features).

    Subclass it, build the functional graph in `__init__` and implement
    `get_config` and `get_moe_layers`; the base gives presets, LoRA, int8
    quantization and the error-safe `fit`/`evaluate`/`predict`.

    Examples:

    ```python
    import keras_vmoe

    backbone = keras_vmoe.models.VisionTransformerBackbone.from_preset(
        "vmoe_b32", load_weights=False, hidden_dim=64, num_heads=4,
        mlp_dim=128, num_layers=4, num_experts=4, image_size=32)
    assert isinstance(backbone, keras_vmoe.models.Backbone)
    path = backbone.save_to_preset("tiny_backbone_preset")
    again = keras_vmoe.models.VisionTransformerBackbone.from_preset(path)
    ```
    """

    @classmethod
    def loads_task(cls, task_class_name):
        return True  # every preset has a backbone

    def get_moe_layers(self):
        """The MoE layers, in order (an empty list for a dense model)."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_moe_layers.")

    def get_layout_map(self, device_mesh, layout="expert", batch_size=None):
        """Layout map that splits this backbone over a device mesh.

        Args:
            device_mesh: `keras_vmoe.distribution.make_mesh(...)` mesh with
                axes `("data", "expert", "model")`.
            layout: `"data"`, `"expert"`, `"expert_model"` or `"pod"` (see
                `keras_vmoe.distribution`).
            batch_size: optional global batch size to check as well.

        Returns:
            A `keras.distribution.LayoutMap` (experts, heads, MLP sizes and
            the batch are checked to divide the mesh axes).

        Example:

        >>> mesh = keras_vmoe.distribution.make_mesh(data=2, expert=4)  # doctest: +SKIP
        >>> layout_map = backbone.get_layout_map(mesh, "expert")  # doctest: +SKIP
        """
        check_divisible(
            dict(zip(device_mesh.axis_names, device_mesh.shape, strict=True)),
            layout, config=self.get_config(), batch_size=batch_size)
        return layout_map(device_mesh, layout)

    @state_guard.restore_on_error
    def fit(self, *args, **kwargs):
        state_guard.check_data_arguments("fit", args, kwargs)
        return super().fit(*args, **kwargs)

    @state_guard.restore_on_error
    def evaluate(self, *args, **kwargs):
        state_guard.check_data_arguments("evaluate", args, kwargs)
        return super().evaluate(*args, **kwargs)

    @state_guard.restore_on_error
    def predict(self, *args, **kwargs):
        state_guard.check_data_arguments("predict", args, kwargs)
        return state_guard.predict_whole_batches(super().predict, args, kwargs)
