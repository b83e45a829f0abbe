"""Deprecated path of `keras_vmoe.malloc_tuning` (importing it warns and gives that module)."""

from keras_vmoe.utils.deprecation import alias_module

alias_module(__name__, "keras_vmoe.malloc_tuning")
