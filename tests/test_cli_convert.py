"""`keras-vmoe convert`: an offline `gs://` read is a one-line error; a URL's
password is never shown nor recorded."""

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


def test_convert_never_shows_a_urls_password(tmp_path, capsys, upstream_dir):
    from http_server import Server

    password = "s3cret-pw"
    with Server(upstream_dir) as server:
        server.auth = ("me", password)
        base = server.base.replace("http://", f"http://me:{password}@")
        for upstream in (f"{base}/missing/checkpoint", f"{base}/vmoe_tiny/none.npz",
                         base.replace(password, "wrong") + "/vmoe_tiny/checkpoint"):
            argv = ["convert", "--upstream", upstream, "--output", str(tmp_path / "o")]
            assert cli.main(argv) == 1
            captured = capsys.readouterr()
            assert "error:" in captured.err and "me:***@" not in captured.err
            assert password not in captured.out + captured.err, captured.err
            assert "http://***@127.0.0.1" in captured.err, captured.err


@pytest.mark.heavy
def test_a_preset_converted_from_a_url_does_not_record_its_password(tmp_path, capsys,
                                                                     upstream_dir):
    from http_server import Server

    password = "s3cret-pw"
    with Server(upstream_dir) as server:
        server.auth = ("me", password)
        base = server.base.replace("http://", f"http://me:{password}@")
        argv = ["convert", "--upstream", f"{base}/vmoe_tiny/checkpoint",
                "--output", str(tmp_path / "preset")]
        assert cli.main(argv) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert password not in captured.out + captured.err
    for path in (tmp_path / "preset").iterdir():
        if path.suffix == ".json":
            assert password not in path.read_text(), path.name
    assert "http://***@127.0.0.1" in (tmp_path / "preset" / "metadata.json").read_text()
