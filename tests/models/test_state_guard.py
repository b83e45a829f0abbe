"""keras_vmoe.models.state_guard: a model stays usable after `predict` or
`evaluate` raise part-way through."""

import numpy as np
import pytest
import tiny_configs

from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone


@pytest.mark.parametrize("method", ["predict", "evaluate"])
def test_a_failing_predict_or_evaluate_keeps_the_model_usable(images, method):
    # Keras' JAX trainer detaches the variables during predict/evaluate and
    # only reattaches them on success: a batch that fails part-way through
    # the loop (here the input's second batch) would leave the model broken
    # ("'NoneType' object is not callable") for every later call.
    model = ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe()), num_classes=3)
    before = model.predict(images[:2], verbose=0)

    def batches():
        yield (images[:2],) if method == "predict" else (images[:2], np.zeros(2))
        raise ValueError("a broken second batch")

    with pytest.raises(ValueError, match="broken second batch"):
        getattr(model, method)(batches(), verbose=0)
    np.testing.assert_array_equal(model.predict(images[:2], verbose=0), before)
    with pytest.raises(ValueError, match="image_size"):
        model.backbone.predict(np.zeros((1, 16, 16, 3)), verbose=0)
    assert model.backbone.predict(images[:2], verbose=0).shape == (2, 32)
