"""Opening files for reading: FIFOs, devices and directories are refused.

FIFOs are real (`os.mkfifo`); each call runs under an alarm so that a
regression fails instead of blocking the suite.
"""

import json
import os

import pytest
from testing import deadline as _deadline  # noqa: E402

from keras_vmoe.utils import safe_files


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with _deadline(), pytest.raises(ValueError, match=r"pipe.json is not a regular file"):
        safe_files.read_json_file(fifo, "settings file")
    with _deadline(), pytest.raises(ValueError, match="not a regular file"):
        safe_files.open_regular(fifo, "weights file")


def test_dev_zero_and_a_directory_are_refused(tmp_path):
    with _deadline(), pytest.raises(ValueError, match="/dev/zero is not a regular file"):
        safe_files.read_json_file("/dev/zero", "settings file")
    with pytest.raises(ValueError, match="is a directory, not a settings file"):
        safe_files.read_json_file(tmp_path, "settings file")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        safe_files.read_json_file(tmp_path / "missing.json", "settings file")


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("{", "not valid JSON"),
    ("[1]", "must hold a JSON object, but holds a list"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_bad_json_names_the_file(tmp_path, text, message):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        safe_files.read_json_file(path, "settings file")
    assert str(path) in str(error.value)


def test_a_regular_file_reads_and_the_error_class_is_the_callers(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"a": 1}))
    assert safe_files.read_json_file(path, "settings file") == {"a": 1}

    class Mine(ValueError):
        pass

    with pytest.raises(Mine):
        safe_files.read_json_file(tmp_path, "settings file", Mine)
