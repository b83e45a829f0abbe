"""keras_vmoe.models.backbone: a new backbone is a subclass of `Backbone`
with no plumbing of its own, and passes the shared test base."""

import keras
import numpy as np
import testing

from keras_vmoe import models


@keras.saving.register_keras_serializable(package="keras_vmoe_tests")
class PatchMeanBackbone(models.Backbone):
    """(B, 8, 8, 3) images -> (B, F): one dense layer on the mean pixel row.

    The smallest subclass the base documents: a functional graph in
    `__init__`, `get_moe_layers` and `get_config`.
    """

    def __init__(self, features=4, **kwargs):
        images = keras.Input((8, 8, 3), name="images")
        rows = keras.layers.Reshape((8, 24), name="rows")(images)
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(rows)
        outputs = keras.layers.Dense(features, name="dense")(pooled)
        super().__init__(inputs=images, outputs=outputs, **kwargs)
        self.features = features

    def get_moe_layers(self):
        return []

    def get_config(self):
        return {**super().get_config(), "features": self.features}


def test_a_subclass_passes_the_shared_base():
    images = np.random.default_rng(0).uniform(-1, 1, size=(2, 8, 8, 3)).astype("float32")
    # No attention: LoRA (query/value projections) has nothing to adapt.
    backbone = testing.run_backbone_test(PatchMeanBackbone, {"features": 4}, images,
                                         (2, 4), run_lora=False)
    assert isinstance(backbone, models.Backbone)
