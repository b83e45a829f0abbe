"""Input pipelines for fine-tuning and evaluation (NumPy or `tf.data`).

`load_dataset(spec, split, image_size=..., batch_size=...)` yields batches
`(images, labels)`: float32 images in [-1, 1] at the model resolution and
int32 labels (one-hot float labels with MixUp). `spec` is

* `"digits"`: the embedded offline default, scikit-learn's 1,797 handwritten
  digits (8×8, 10 classes, shipped in the package), upsampled; fixed splits
  `"train"` (1,437) and `"test"` (360);
* `"tfds:NAME"` (e.g. `"tfds:cifar10"`), any TFDS dataset with `image` and
  `label` features; `split` uses TFDS slicing (`"train[:90%]"`);
* a folder with one sub-folder per class (or `train/`, `test/`, ... split
  folders that each hold class sub-folders);
* a tuple `(images, labels)` of NumPy arrays.

`class_names(spec)` returns the class names of a dataset;
`imagenet_class_names()` the 1,000 ImageNet-1k names that the released
ILSVRC presets predict. `pipeline="numpy"` (the
default for the digits, and for arrays and folders without TensorFlow)
yields a `keras.utils.PyDataset` and needs no TensorFlow; `pipeline="tf"` a
`tf.data.Dataset` (the `[tensorflow]` extra; TFDS needs `[data]`).
"""

from keras_vmoe.data.labels import imagenet_class_names
from keras_vmoe.data.pipeline import class_names
from keras_vmoe.data.pipeline import load_dataset
from keras_vmoe.data.sources import DIGITS_SPLITS
from keras_vmoe.data.sources import load_digits_arrays

__all__ = ["DIGITS_SPLITS", "class_names", "imagenet_class_names", "load_dataset",
           "load_digits_arrays"]
