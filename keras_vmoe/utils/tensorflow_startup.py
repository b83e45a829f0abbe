"""TensorFlow's start-up lines (absl, oneDNN, CPU features), kept off stderr.

`quiet_imports()` makes each later import of TensorFlow pass on every
stderr line but `STARTUP_LINES`, unless `TF_CPP_MIN_LOG_LEVEL` is 0 or 1.
"""

import os
import re
import sys

from keras_vmoe.utils import import_hooks

# The lines TensorFlow writes while it is imported that say nothing to act on.
STARTUP_LINES = (
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called "
               r"are written to STDERR"),
    re.compile(r"[IWE]\d{4} [\d:.]+\s+\d+ port\.cc:\d+\] oneDNN custom operations are on\..*"),
    re.compile(r"[IWE]\d{4} [\d:.]+\s+\d+ cpu_feature_guard\.cc:\d+\] .*"),
    re.compile(r"To enable the following instructions: .* rebuild TensorFlow with the "
               r"appropriate compiler flags\."),
    re.compile(r"E\d{4} [\d:.]+\s+\d+ \S+\] .*AVX-?512.*"),
)


def is_startup_line(line):
    """Whether `line` (without its newline) is one of `STARTUP_LINES`."""
    return any(pattern.fullmatch(line) for pattern in STARTUP_LINES)


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass


def without_startup_lines(execute, module):
    """Runs `execute(module)` with fd 2 captured, then writes it back less
    the `STARTUP_LINES`."""
    import tempfile  # here: it would add milliseconds to `import keras_vmoe`

    _flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to capture
        execute(module)
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            execute(module)
        finally:
            _flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not is_startup_line(line.rstrip("\r\n")))
            if kept:
                os.write(2, kept.encode("utf-8"))


def quiet_imports():
    """Keeps `STARTUP_LINES` off stderr at each later import of TensorFlow."""
    if "tensorflow" in sys.modules:
        return
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2").strip() in ("0", "1"):
        return
    import_hooks.around_import("tensorflow", "tensorflow_startup", without_startup_lines)
