"""keras-vmoe convert: upstream vmoe checkpoint -> Keras preset.

Its arguments are parsed by `keras_vmoe.checkpoints.convert.build_parser`.
"""

PASS_THROUGH = True


def main(argv) -> int:
    from keras_vmoe.checkpoints import convert

    return convert.main(argv, prog="keras-vmoe convert")
