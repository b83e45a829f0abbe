"""Runs a user can trust: stop, kill and resume; damaged checkpoints; NaN.

The fault tests start real processes (`resumable_child.py`) and hurt them
at chosen moments: SIGKILL mid-epoch and half-way through a checkpoint
write, SIGINT after a step, during evaluation, during a checkpoint write and
while compiling, SIGTERM. Each stopped run is then resumed by running the
same command again, and must end with the weights of the uninterrupted run,
bit for bit (same machine, same programs), and with its whole history.
The real-process tests are marked `faults` (`.ci/run` runs them: `pytest
-m faults`); the default suite has the in-process ones here and the
in-process kill-and-resume equality test in `test_finetuning.py`.
"""

import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import training
from keras_vmoe.training import checkpoints
from keras_vmoe.training.checkpoints import CheckpointStore

CHILD = os.path.join(os.path.dirname(__file__), "resumable_child.py")
STEPS_PER_EPOCH = 6  # 96 images, batch 16
EPOCHS = 3


def _child(out, *mode, pipeline="tf"):
    env = dict(os.environ, RESUMABLE_PIPELINE=pipeline)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, CHILD, str(out), *map(str, mode)],
                          capture_output=True, text=True, env=env, timeout=600)


def _weights(out):
    with np.load(os.path.join(out, "final.npz")) as f:
        return {k: f[k] for k in f.files}


def _history(out):
    with open(os.path.join(out, "history.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    result = _child(out, "none")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _assert_same_run(out, reference):
    want, got = _weights(reference), _weights(out)
    assert want.keys() == got.keys()
    for key in want:
        assert np.array_equal(want[key], got[key]), (
            f"weight {key}: max |diff| {np.max(np.abs(want[key] - got[key]))}")
    history, ref_history = _history(out), _history(reference)
    assert history["history"] == ref_history["history"]  # every epoch, exactly
    assert len(history["history"]["loss"]) == EPOCHS


def _resume(out, stderr_expects):
    result = _child(out, "none")
    assert result.returncode == 0, result.stderr[-3000:]
    assert stderr_expects in result.stderr, result.stderr[-3000:]
    return result


@pytest.mark.faults
def test_kill_mid_epoch_then_sigint_then_resume_equals_uninterrupted(reference, tmp_path):
    killed = _child(tmp_path, "kill", 8)  # SIGKILL at step 2 of epoch 2
    assert killed.returncode == -signal.SIGKILL
    # The rerun resumes from the end of epoch 1; Ctrl-C arrives after its
    # 3rd step (global step 9) and it stops after the next one (step 10).
    stopped = _child(tmp_path, "int", 3)
    assert "resuming from epoch 1 (step 0" in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "stopped by SIGINT (Ctrl-C) after epoch 1, step 4" in stopped.stderr
    _resume(tmp_path, "resuming from epoch 1 (step 4; global step 10)")
    _assert_same_run(tmp_path, reference)


@pytest.mark.faults
def test_numpy_pipeline_kill_mid_epoch_then_sigint_then_resume(tmp_path):
    # The same real-process kill, Ctrl-C and resume through the TensorFlow-free
    # pipeline, against its own uninterrupted run.
    reference = tmp_path / "reference"
    done = _child(reference, "none", pipeline="numpy")
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "stopped"
    killed = _child(out, "kill", 8, pipeline="numpy")  # step 2 of epoch 2
    assert killed.returncode == -signal.SIGKILL
    stopped = _child(out, "int", 3, pipeline="numpy")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "stopped by SIGINT (Ctrl-C) after epoch 1, step 4" in stopped.stderr
    resumed = _child(out, "none", pipeline="numpy")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from epoch 1 (step 4; global step 10)" in resumed.stderr
    assert "differ from an uninterrupted run" not in resumed.stderr
    _assert_same_run(out, reference)


@pytest.mark.faults
def test_kill_inside_a_checkpoint_write_then_resume(reference, tmp_path):
    # The 2nd checkpoint (end of epoch 2) is half-written when SIGKILL lands.
    killed = _child(tmp_path, "kill-in-write", 2)
    assert killed.returncode == -signal.SIGKILL
    leftovers = os.listdir(tmp_path / "ckpt")
    assert any(f.endswith(checkpoints.TMP_SUFFIX) for f in leftovers), leftovers
    _resume(tmp_path, "resuming from epoch 1 (step 0")
    assert not any(f.endswith(checkpoints.TMP_SUFFIX) for f in os.listdir(tmp_path / "ckpt"))
    _assert_same_run(tmp_path, reference)


@pytest.mark.faults
def test_sigint_while_compiling_evaluating_writing_then_sigterm_then_resume(reference,
                                                                              tmp_path):
    # One run stopped four times, each stop in a new process that resumes the
    # previous one: Ctrl-C while the first step compiles, during an
    # evaluation, inside a checkpoint write, then SIGTERM after a step. The
    # last process finishes it; one more finds it complete.
    stops = [
        (("int-now",), 130, None),
        (("int-eval", 1), 130, "resuming from epoch 0 (step 1"),
        (("int-write", 1), 130, "resuming from epoch 1 (step 0"),
        (("term", 2), 143, "resuming from epoch 2 (step 0"),
    ]
    for mode, code, resumes_from in stops:
        stopped = _child(tmp_path, *mode)
        assert stopped.returncode == code, (mode, stopped.stderr[-3000:])
        if code == 130:
            assert "run it again with the same checkpoint directory" in stopped.stderr
        else:
            assert "SIGTERM" in stopped.stderr
        if resumes_from is not None:
            assert resumes_from in stopped.stderr, (mode, stopped.stderr[-3000:])
    _resume(tmp_path, "resuming from epoch 2 (step 3")
    _assert_same_run(tmp_path, reference)
    again = _child(tmp_path, "none")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run is already complete (3 epochs" in again.stderr
    _assert_same_run(tmp_path, reference)


@pytest.mark.faults
def test_nan_image_stops_training_naming_the_step(tmp_path):
    result = _child(tmp_path, "nan")
    assert result.returncode == 1, result.stderr[-3000:]
    # Image 37 is in the 3rd batch of 16 (no shuffling in this pipeline).
    assert "training loss became nan at epoch 1, step 3 of 6" in result.stderr
    assert "no checkpoint was written" in result.stderr
    assert not os.path.exists(tmp_path / "ckpt" / "checkpoint.json")
    assert not os.path.exists(tmp_path / "final.npz")


# -- in-process: the checkpoint store ------------------------------------------


def _save(store, step, value):
    return store.save({"model/00000": np.full((4096,), value, "float32")},
                      {"global_step": step, "epoch": step, "step": 0})


def test_store_keeps_the_previous_checkpoint_and_falls_back(tmp_path, capsys):
    store = CheckpointStore(tmp_path)
    _save(store, 1, 1.0)
    _save(store, 2, 2.0)
    newest = _save(store, 3, 3.0)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".npz")) == [
        "ckpt-0000000002.npz", "ckpt-0000000003.npz"]
    with open(newest, "r+b") as f:  # damage the newest: truncate it
        f.truncate(os.path.getsize(newest) // 2)
    arrays, meta, path = store.load()
    assert meta["global_step"] == 2 and arrays["model/00000"][0] == 2.0
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged" in err and "falling back" in err


def test_store_detects_flipped_bytes_and_a_lost_index(tmp_path, capsys):
    store = CheckpointStore(tmp_path)
    _save(store, 1, 1.0)
    newest = _save(store, 2, 2.0)
    data = bytearray(open(newest, "rb").read())
    data[len(data) // 3] ^= 0xFF  # inside the 16 KB array
    open(newest, "wb").write(bytes(data))
    assert store.load()[1]["global_step"] == 1
    assert "SHA-256 differs" in capsys.readouterr().err
    os.remove(tmp_path / checkpoints.POINTER)  # the index lost too: zip CRCs
    assert store.load()[1]["global_step"] == 1


def test_store_with_nothing_usable_says_how_to_start_again(tmp_path):
    store = CheckpointStore(tmp_path)
    path = _save(store, 1, 1.0)
    open(path, "wb").write(b"not a checkpoint")
    with pytest.raises(training.CheckpointError, match="--overwrite"):
        store.load()


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    store = CheckpointStore(tmp_path)
    _save(store, 1, 1.0)

    def full_disk(f):
        raise OSError(errno.ENOSPC, "No space left on device")

    original = checkpoints.write_atomic
    monkeypatch.setattr(checkpoints, "write_atomic",
                        lambda path, data: original(path, full_disk))
    with pytest.raises(OSError, match="No space left"):
        _save(store, 2, 2.0)
    monkeypatch.undo()
    assert not any(f.endswith(checkpoints.TMP_SUFFIX) for f in os.listdir(tmp_path))
    assert store.load()[1]["global_step"] == 1


# -- in-process: finetune -------------------------------------------------------


def _tiny(seed=0):
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone

    keras.utils.set_random_seed(seed)
    return ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro()),
                           num_classes=3)


def _tf_data(n=16, batch=8):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (n, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


@pytest.mark.heavy  # ~20-30 s on 2 cores (trains two short runs); .ci/run runs the group
def test_other_settings_in_the_checkpoint_dir_are_refused(tmp_path):
    training.finetune(_tiny(), _tf_data(), epochs=1, checkpoint_dir=tmp_path,
                      verbose=0, learning_rate=0.1)
    with pytest.raises(training.CheckpointError,
                       match=r"other settings \(epochs: 1 -> 2.*--overwrite"):
        training.finetune(_tiny(), _tf_data(), epochs=2, checkpoint_dir=tmp_path,
                          verbose=0, learning_rate=0.1)
    history = training.finetune(_tiny(), _tf_data(), epochs=2, checkpoint_dir=tmp_path,
                                verbose=0, learning_rate=0.1, overwrite=True)
    assert len(history.history["loss"]) == 2 and history.resumed_from is None


# -- in-process: checkpoints of another run, tampered checkpoints ---------------


def _model(router="token_choice", seed=0):
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone

    keras.utils.set_random_seed(seed)
    return ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro(router)),
                           num_classes=10)


def _digits(seed=0, flip=False):
    from keras_vmoe import data

    return data.load_dataset("digits", "train[:32]", image_size=8, batch_size=16,
                             training=True, seed=seed, flip=flip, pipeline="numpy")


def test_an_index_of_another_run_is_refused_before_any_batch(tmp_path):
    (tmp_path / checkpoints.POINTER).write_text(json.dumps(
        {"checkpoints": [], "settings": {"epochs": 5}}))

    class Unreadable(keras.utils.PyDataset):
        class_names = [str(i) for i in range(10)]

        def __len__(self):
            return 2

        def __getitem__(self, index):
            raise AssertionError("a batch was read before the settings check")

    with pytest.raises(training.CheckpointError, match=r"other settings \(.*epochs: 5 -> 1"):
        training.finetune(_model(), Unreadable(), epochs=1, checkpoint_dir=tmp_path,
                          verbose=0)


@pytest.mark.heavy  # ~30 s on 2 cores (trains three one-epoch runs)
def test_resume_refuses_other_data_or_router_and_tampered_checkpoints(tmp_path):
    run = dict(epochs=1, checkpoint_dir=tmp_path, verbose=0, learning_rate=0.1)
    training.finetune(_model(), _digits(), **run)
    with pytest.raises(training.CheckpointError, match=r"data\.seed: 0 -> 1.*--overwrite"):
        training.finetune(_model(), _digits(seed=1), **run)
    with pytest.raises(training.CheckpointError, match=r"data\.flip: False -> True"):
        training.finetune(_model(), _digits(flip=True), **run)
    with pytest.raises(training.CheckpointError, match=r"other settings \(model: "):
        training.finetune(_model("expert_choice"), _digits(), **run)
    # A finished run whose record lost its layout: damaged, not "complete".
    (path,) = [str(p) for p in tmp_path.glob("ckpt-*.npz")]
    with np.load(path) as data:
        stored = {k: data[k] for k in data.files}
    meta = json.loads(bytes(stored[checkpoints.META_KEY]).decode())
    meta["layout"] = {}
    stored[checkpoints.META_KEY] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **stored)
    os.remove(tmp_path / checkpoints.POINTER)
    with pytest.raises(training.CheckpointError,
                       match=r"No usable checkpoint.*its layout has no 'model'"):
        training.finetune(_model(), _digits(), **run)
    # Starting again keeps a file the run did not write.
    foreign = tmp_path / "ckpt-0000000099.npz"
    foreign.write_bytes(b"the user's file")
    history = training.finetune(_model(), _digits(), overwrite=True, **run)
    assert history.resumed_from is None and foreign.read_bytes() == b"the user's file"
    assert training.finetune(_model(), _digits(), **run).resumed_from is None


def test_a_refusal_names_the_class_names_that_changed(tmp_path):
    from keras_vmoe.training import run_control

    stored = {"data": {"classes": "3 classes, sha256 aaa",
                       "class_names": ["cat", "dog", "fox"]}}
    (tmp_path / checkpoints.POINTER).write_text(json.dumps(
        {"checkpoints": [], "settings": stored}))
    current = {"data": {"classes": "3 classes, sha256 bbb",
                        "class_names": ["cat", "dog", "owl"]}}
    with pytest.raises(training.CheckpointError,
                       match=r"data\.class_names: removed \['fox'\]; added \['owl'\]"):
        run_control.check_resumable(tmp_path, current)
    reordered = {"data": {"classes": "3 classes, sha256 ccc",
                          "class_names": ["dog", "cat", "fox"]}}
    with pytest.raises(training.CheckpointError, match=r"the same names in another order"):
        run_control.check_resumable(tmp_path, reordered)
