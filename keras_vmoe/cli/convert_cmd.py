"""keras-vmoe convert: upstream vmoe checkpoint -> Keras preset.

Its arguments are parsed by `keras_vmoe.checkpoints.convert.build_parser`.
A checkpoint that cannot be read from storage (e.g. `gs://` offline) ends in
one `error:` line that says what to do, not a TensorFlow traceback.
"""

import sys

PASS_THROUGH = True


def _is_storage_error(error):
    """TensorFlow's file-system errors (`tf.errors.OpError` subclasses such as
    `FailedPreconditionError`, `NotFoundError`, `UnavailableError`), checked
    by module so that TensorFlow is never imported here."""
    return any(cls.__module__.startswith("tensorflow") and cls.__name__ == "OpError"
               for cls in type(error).__mro__)


def _upstream(argv):
    for index, arg in enumerate(argv):
        if arg.startswith("--upstream="):
            return arg.split("=", 1)[1]
        if arg == "--upstream" and index + 1 < len(argv):
            return argv[index + 1]
    return "the checkpoint"


def main(argv) -> int:
    from keras_vmoe.checkpoints import convert

    try:
        return convert.main(argv, prog="keras-vmoe convert")
    except Exception as error:
        if not _is_storage_error(error):
            raise
        source = _upstream(argv)
        detail = (str(getattr(error, "message", "") or error).strip().splitlines()
                  or [""])[0]
        hint = (" Reading gs:// needs network access to Google Cloud Storage; "
                "offline, copy the checkpoint's .index and .data-* files to a local "
                "folder and pass that prefix."
                if str(source).startswith("gs://") else "")
        print(f"error: cannot read {source} ({type(error).__name__}: {detail}).{hint}",
              file=sys.stderr)
        return 1
