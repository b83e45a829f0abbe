"""Input pipelines for fine-tuning and evaluation (NumPy or `tf.data`).

`load_dataset(spec, split, image_size=..., batch_size=...)` yields batches of
float32 images in [-1, 1] and int32 labels from the embedded `"digits"`
(scikit-learn's 1,797 handwritten digits: `"train"` 1,437, `"test"` 360),
`"tfds:NAME"`, a folder of class sub-folders or `(images, labels)` arrays.
`class_names(spec)` names a dataset's classes; `imagenet_class_names()` the
1,000 classes of the released ILSVRC presets.
"""

from keras_vmoe.data.labels import imagenet_class_names
from keras_vmoe.data.pipeline import class_names
from keras_vmoe.data.pipeline import load_dataset
from keras_vmoe.data.sources import DIGITS_SPLITS
from keras_vmoe.data.sources import load_digits_arrays

__all__ = ["DIGITS_SPLITS", "class_names", "imagenet_class_names", "load_dataset",
           "load_digits_arrays"]
