"""Image preprocessing: the model's input converter and training augmentation.

* `ImageConverter`: raw images (`uint8` in [0, 255], or floats in a declared
  range) at any resolution -> float32 in [-1, 1] at the model resolution
  (plain resize, or central square crop + resize for evaluation, as
  upstream's `resize_small|central_crop`). Tasks hold one
  (`task.preprocessor.image_converter`) and apply it in `fit`, `evaluate` and `predict`;
  it is stored in presets.
* `InceptionCrop`: Inception-style random-resized crop (Keras core has none).
* `UpstreamMixUp`: MixUp as upstream (one sorted Dirichlet weight per
  device batch, each example mixed with the next); the default of
  `training_augmentation(mixup=...)`.
* `UpstreamRandAugment`: RandAugment as upstream (the TPU-models
  `distort_image_with_randaugment`: 16 operations, magnitude scale, fill
  128), TensorFlow and NumPy; the default of `randaugment=(N, M)`.
* `training_augmentation(...)`: the upstream fine-tuning augmentation built
  from Keras core preprocessing layers (they run inside `tf.data`).
"""

from keras_vmoe.preprocessing.augmentation import InceptionCrop
from keras_vmoe.preprocessing.augmentation import UpstreamMixUp
from keras_vmoe.preprocessing.augmentation import training_augmentation
from keras_vmoe.preprocessing.image_converter import ImageConverter
from keras_vmoe.preprocessing.randaugment import UpstreamRandAugment

__all__ = ["ImageConverter", "InceptionCrop", "UpstreamMixUp", "UpstreamRandAugment",
           "training_augmentation"]
