"""`keras-vmoe` command line.

Each command module defines `add_arguments(parser)` (cheap: no Keras, JAX or
TensorFlow import) and `run(args) -> int`; a `PASS_THROUGH = True` module
defines `main(argv) -> int` instead. User errors print one `error: ...` line
and exit 1; argument errors exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys

from keras_vmoe import __version__
from keras_vmoe.cli import hugepages

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# name -> (module, one-line help). The first command is the default job.
COMMANDS = {
    "finetune": ("keras_vmoe.cli.finetune",
                 "fine-tune a V-MoE on a dataset (default: embedded digits)"),
    "predict": ("keras_vmoe.cli.predict",
                "classify image files or folders with a preset"),
    "evaluate": ("keras_vmoe.cli.evaluate",
                 "evaluate a preset: accuracy, calibration, routing, capacity"),
    "demo": ("keras_vmoe.cli.demo",
             "route real photos through a V-MoE and report routing"),
    "presets": ("keras_vmoe.cli.presets_cmd", "list the preset catalog"),
    "convert": ("keras_vmoe.cli.convert_cmd",
                "convert an upstream vmoe checkpoint to a preset"),
    "upcycle": ("keras_vmoe.cli.upcycle",
                "sparse upcycling: dense ViT -> MoE preset (experts = copies of the MLP)"),
    "upload": ("keras_vmoe.cli.upload_cmd",
               "upload a preset to Hugging Face (hf://) or Kaggle (kaggle://)"),
    "export": ("keras_vmoe.cli.export_cmd",
               "export a preset to TensorFlow SavedModel or ONNX for serving"),
    "quantize": ("keras_vmoe.cli.quantize_cmd",
                 "int8 preset (W8A8 dense and attention, int8-weight experts)"),
    "plan": ("keras_vmoe.cli.plan",
             "per-device memory of a training step on a device mesh"),
    "launch": ("keras_vmoe.cli.launch",
               "run a script as N local JAX processes (multi-host test)"),
}
DEFAULT_COMMAND = "finetune"
# Options of `keras-vmoe` itself (everything else before a command goes to
# the default command).
_TOP_LEVEL_OPTIONS = ("-h", "--help", "--version")
# Commands that run models: started as a program, they re-run themselves with
# glibc's huge-page tunable (`keras_vmoe.cli.hugepages`).
COMPUTE_COMMANDS = ("finetune", "predict", "evaluate", "demo")


class CliError(Exception):
    """An error the user can fix; printed as `error: ...` without a traceback."""


class _Parser(argparse.ArgumentParser):
    """No abbreviated options; an unknown option gets close names as suggestions."""

    command = None  # the subcommand being parsed: suggestions come from its options

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args and args[0] in self._command_parsers():
            self.command = args[0]
        return super().parse_known_args(args, namespace)

    def _command_parsers(self):
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices
        return {}

    def _all_options(self, command=None):
        options = set(self._option_string_actions)
        for name, sub in self._command_parsers().items():
            if command is None or name == command:
                options.update(sub._option_string_actions)
        return sorted(o for o in options if o.startswith("--"))

    def error(self, message):
        unknown = re.findall(r"(?:^| )(--[\w-]+)", message.partition("unrecognized arguments:")[2])
        hints = []
        command = self.command if self.command in self._command_parsers() else None
        for option in unknown:  # `--name` without `=value`
            close = _close_options(option, self._all_options(command))
            if close:
                hints.append(f"{option}: did you mean {' or '.join(close)}?")
            elif command is not None:
                others = [other for other, sub in self._command_parsers().items()
                          if option in sub._option_string_actions]
                if others:
                    hints.append(
                        f"{option} is an option of `keras-vmoe "
                        f"{'`, `keras-vmoe '.join(others)}`, not of `keras-vmoe {command}`")
        if hints:
            message = f"{message} ({'; '.join(hints)})"
        super().error(message)


def _close_options(option, options):
    """Options that differ from `option` only in dashes, or are spelled close."""
    import difflib

    def bare(name):
        return name.lstrip("-").replace("-", "").replace("_", "")

    same = [o for o in options if bare(o) == bare(option)]
    return same or difflib.get_close_matches(option, options, n=2, cutoff=0.75)


def build_parser():
    parser = _Parser(prog="keras-vmoe", description=(
        "Vision Mixture-of-Experts for Keras 3 (V-MoE, Soft MoE, E³). "
        f"With no command, runs `keras-vmoe {DEFAULT_COMMAND}`."))
    parser.add_argument("--version", action="version",
                        version=f"keras-vmoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        if getattr(module, "PASS_THROUGH", False):
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        command = sub.add_parser(
            name, help=help_text, description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
    return parser


# OSError: a full disk, a read-only or missing folder (the messages name the
# path): the user's to fix, not bugs.
_USER_ERRORS = (CliError, ValueError, OSError, KeyError)


def main(argv=None) -> int:
    as_program = argv is None  # the console script, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        if getattr(module, "PASS_THROUGH", False):
            return module.main(argv[1:])
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in _TOP_LEVEL_OPTIONS):
        # Options without a command are the default command's.
        args = parser.parse_args([DEFAULT_COMMAND, *argv])
    else:
        args = parser.parse_args(argv)
    if as_program and args.command in COMPUTE_COMMANDS:
        hugepages.reexec_with_hugepages(argv)  # returns only when it does not apply
    module = importlib.import_module(COMMANDS[args.command][0])
    args.argv = argv  # what the user typed (e.g. to print the resume command)
    json_only = getattr(args, "json", False)
    try:
        with _stdout_for_json_only() if json_only else contextlib.nullcontext():
            return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _USER_ERRORS as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        message = _weights_advice(str(message), error, args.command)
        print(f"error: {message}", file=sys.stderr)
        return 1
    except ImportError as error:
        missing = _missing_backend(error)
        if missing is None and "pip install" not in str(error):  # a bug
            raise
        print(f"error: {missing or error}", file=sys.stderr)
        return 1


def _weights_advice(message, error, command):
    """Missing preset weights: the command's option instead of `load_weights=False`."""
    from keras_vmoe.presets import released  # lazy: no Keras at CLI start-up

    unavailable = released.PresetWeightsUnavailableError
    hint = unavailable.RANDOM_WEIGHTS_HINT
    if not isinstance(error, unavailable) or hint not in message:
        return message
    if "--no-weights" in build_parser()._command_parsers()[command]._option_string_actions:
        instead = ("Pass --no-weights to build the architecture with random weights "
                   f"(`keras-vmoe {command} --no-weights ...`).")
    else:
        instead = f"`keras-vmoe {command}` needs the weights."
    return message.replace(hint, instead)


def _missing_backend(error):
    """The message for a Keras backend that is selected but not installed."""
    backend = os.environ.get("KERAS_BACKEND", "")
    name = getattr(error, "name", None) or ""
    if backend and name.split(".")[0] == backend:
        return (f"KERAS_BACKEND={backend} but the {backend!r} package is not installed "
                f"({error}). Install it, or unset KERAS_BACKEND to use JAX (the "
                "default of keras-vmoe).")
    return None


_JSON_STREAM = None


@contextlib.contextmanager
def _stdout_for_json_only():
    """With --json: stdout carries the JSON alone, everything else goes to stderr.

    `sys.stdout` and file descriptor 1 (where C libraries print) point at
    stderr meanwhile; `emit_json` writes to the real stdout.
    """
    global _JSON_STREAM
    sys.stdout.flush()
    saved_stdout, saved_fd = sys.stdout, None
    try:
        real = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):
        real = False  # a Python stream (tests, notebooks): no fd to move
    if real:
        saved_fd = os.dup(1)
        os.dup2(2, 1)
        _JSON_STREAM = os.fdopen(os.dup(saved_fd), "w", encoding="utf-8")
    else:
        _JSON_STREAM = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = saved_stdout
        if saved_fd is not None:
            _JSON_STREAM.close()
            sys.stderr.flush()
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
        _JSON_STREAM = None


def emit_json(payload) -> None:
    """Prints `payload` as JSON on the real stdout (see `--json`)."""
    import json

    emit_text(json.dumps(payload, indent=2, default=float))


def emit_text(text: str) -> None:
    """Prints `text` on the real stdout, also while --json redirects it."""
    stream = _JSON_STREAM or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def progress(message: str) -> None:
    """Prints one progress line to stderr (long steps: building, compiling, ...)."""
    print(f"[keras-vmoe] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
