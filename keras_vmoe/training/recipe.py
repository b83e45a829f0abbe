"""Deprecated path of `keras_vmoe.training.finetuning` (importing it warns, gives that module)."""

from keras_vmoe.utils.deprecation import alias_module

alias_module(__name__, "keras_vmoe.training.finetuning")
