"""Image preprocessing: the model's input converter and training augmentation.

`ImageConverter` maps raw images to the model input (tasks hold one);
`InceptionCrop`, `UpstreamMixUp`, `UpstreamRandAugment` and
`training_augmentation` reproduce upstream's fine-tuning augmentation.
"""

from keras_vmoe.preprocessing.augmentation import InceptionCrop
from keras_vmoe.preprocessing.augmentation import UpstreamMixUp
from keras_vmoe.preprocessing.augmentation import training_augmentation
from keras_vmoe.preprocessing.image_converter import ImageConverter
from keras_vmoe.preprocessing.randaugment import UpstreamRandAugment

__all__ = ["ImageConverter", "InceptionCrop", "UpstreamMixUp", "UpstreamRandAugment",
           "training_augmentation"]
