"""A tiny resumable fine-tuning run, started as a real process by the tests.

    python resumable_child.py OUT_DIR MODE [ARG]

Fine-tunes a tiny V-MoE (noisy router, dropout) on 96 embedded digits with
a shuffling, augmenting `load_dataset` pipeline, checkpointing into
OUT_DIR/ckpt, and writes the final weights to OUT_DIR/final.npz and the
history to OUT_DIR/history.json. MODE makes the process hurt itself at a
chosen moment, as a user or the system would:

* `none`: run to the end.
* `kill STEP`: SIGKILL itself after global training step STEP.
* `kill-in-write N`: SIGKILL itself half-way through writing checkpoint N.
* `int STEP` / `term STEP`: send itself SIGINT / SIGTERM after step STEP.
* `int-eval N`: SIGINT during this process's N-th evaluation (1-based).
* `int-write N`: SIGINT while checkpoint N is being written.
* `int-now`: SIGINT from a timer 0.05 s after `fit` starts (compiling).
* `nan`: one all-NaN image in the training arrays.

`RESUMABLE_PIPELINE=numpy` in the environment trains through the NumPy
pipeline (`load_dataset(pipeline="numpy")`) instead of `tf.data`.

The exit code is the one `keras-vmoe finetune` would give (130 / 143 after
a stop, 1 after an error).
"""

import json
import os
import signal
import sys
import threading

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_vmoe import data  # noqa: E402
from keras_vmoe import training  # noqa: E402
from keras_vmoe.models import ImageClassifier  # noqa: E402
from keras_vmoe.models import VisionTransformerBackbone  # noqa: E402
from keras_vmoe.training import checkpoints  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tiny_configs  # noqa: E402  (tests/tiny_configs.py)

EPOCHS = 3
BATCH = 16
TINY = tiny_configs.vmoe_8px(router={"noise_std": 1.0}, dropout_rate=0.1)


class Hurt(keras.callbacks.Callback):
    def __init__(self, mode, arg):
        super().__init__()
        self.mode, self.arg, self.step, self.evals = mode, arg, 0, 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == self.arg:
            sig = {"kill": signal.SIGKILL, "int": signal.SIGINT,
                   "term": signal.SIGTERM}.get(self.mode)
            if sig is not None:
                os.kill(os.getpid(), sig)

    def on_train_begin(self, logs=None):
        if self.mode == "int-now":  # lands while the first step compiles
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()

    def on_test_begin(self, logs=None):
        self.evals += 1

    def on_test_batch_end(self, batch, logs=None):
        if self.mode == "int-eval" and self.evals == self.arg and batch == 0:
            os.kill(os.getpid(), signal.SIGINT)


def _hurt_writes(mode, n):
    original = checkpoints.write_atomic
    count = {"n": 0}

    def write_atomic(path, payload):
        if not os.path.basename(path).startswith(checkpoints.PREFIX):
            return original(path, payload)
        count["n"] += 1
        if count["n"] != n:
            return original(path, payload)

        def half_then_kill(f):
            payload(f)
            f.flush()
            f.truncate(f.tell() // 2)  # the kill lands half-way through
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        if mode == "kill-in-write":
            return original(path, half_then_kill)

        # SIGINT lands inside the write: the handler only records it, the
        # write completes (a whole file), and the run stops after it.
        def signal_inside(f):
            os.kill(os.getpid(), signal.SIGINT)
            payload(f)

        return original(path, signal_inside)

    checkpoints.write_atomic = write_atomic


def main(out, mode="none", arg=None):
    arg = None if arg is None else int(arg)
    os.makedirs(out, exist_ok=True)
    keras.utils.set_random_seed(0)
    images, labels = data.load_digits_arrays("train[:96]")
    # RESUMABLE_PIPELINE=numpy: the TensorFlow-free pipeline (default: tf.data).
    train = data.load_dataset((images, labels), "train", image_size=8,
                              batch_size=BATCH, training=True, seed=3,
                              crop_area_range=(0.5, 1.0),
                              pipeline=os.environ.get("RESUMABLE_PIPELINE", "tf"))
    if mode == "nan":  # past load_dataset's checks, which refuse NaN pixels
        import tensorflow as tf

        x = np.asarray(images, "float32")[:, :, :, :] / 127.5 - 1.0
        x[37] = np.nan
        train = tf.data.Dataset.from_tensor_slices((x, labels)).batch(BATCH)
    test = data.load_dataset("digits", "test[:32]", image_size=8, batch_size=BATCH)
    model = ImageClassifier(VisionTransformerBackbone(**TINY), num_classes=10)
    if mode in ("kill-in-write", "int-write"):
        _hurt_writes(mode, arg)
    try:
        history = training.finetune(
            model, train, test, epochs=EPOCHS, learning_rate=0.1, verbose=0,
            checkpoint_dir=os.path.join(out, "ckpt"), callbacks=[Hurt(mode, arg)])
    except training.TrainingInterrupted as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        return stop.exit_code
    except training.NonFiniteLossError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    np.savez(os.path.join(out, "final.npz"),
             **{f"{i:04d}": np.asarray(v) for i, v in enumerate(model.weights)})
    with open(os.path.join(out, "history.json"), "w") as f:
        json.dump({"history": history.history, "resumed_from": history.resumed_from,
                   "fit_seconds": history.fit_seconds}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
