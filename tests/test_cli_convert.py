"""`keras-vmoe convert`: an offline `gs://` read is a one-line error."""

import pytest

from keras_vmoe import cli


def test_convert_offline_gs_error_is_one_line(monkeypatch, capsys):
    from keras_vmoe.cli import convert_cmd

    # The class TensorFlow raises (tf.errors.FailedPreconditionError), faked
    # without TensorFlow: the check goes by module and base-class name.
    OpError = type("OpError", (Exception,),
                   {"__module__": "tensorflow.python.framework.errors_impl"})
    Failed = type("FailedPreconditionError", (OpError,), {
        "__module__": "tensorflow.python.framework.errors_impl"})

    def offline(argv, prog=None):
        raise Failed("Error executing an HTTP request: libcurl code 6 meaning "
                     "'Couldn't resolve host name'\n\twhen reading gs://vmoe/x")

    monkeypatch.setattr(convert_cmd, "run", offline)
    argv = ["convert", "--upstream", "gs://vmoe_checkpoints/x", "--output", "out"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read gs://vmoe_checkpoints/x (FailedPrecondition")
    assert "network access" in err and "Traceback" not in err and err.count("\n") == 1
    monkeypatch.setattr(convert_cmd, "run", lambda argv, prog=None: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # other errors are bugs: not hidden
        cli.main(argv)
