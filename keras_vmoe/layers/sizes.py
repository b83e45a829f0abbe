"""Deprecated path of `keras_vmoe.layers.symbolic_sizes`.

Importing it warns and gives that module.
"""

from keras_vmoe.utils.deprecation import alias_module

alias_module(__name__, "keras_vmoe.layers.symbolic_sizes")
