"""Runs `fit` so that it can be stopped, killed and resumed exactly.

`run_training` wraps `model.fit` with stop signals (SIGINT/SIGTERM stop
after the current step, state saved), a checkpoint every epoch, an exact
resume (weights, optimizer, seeds, metrics and the data position), and a
stop at the first non-finite loss (see docs/guides/reliability.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time

import keras
import numpy as np

from keras_vmoe.training.checkpoints import CheckpointError
from keras_vmoe.training.checkpoints import CheckpointStore
from keras_vmoe.training.checkpoints import DamagedCheckpoint
from keras_vmoe.utils.arrays import nbytes
from keras_vmoe.utils.keras_internals import flatten_layers
from keras_vmoe.utils.keras_internals import symbolic_build
from keras_vmoe.utils.keras_internals import sync_jax_state

_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by a signal after checkpointing its state.

    Attributes:
        signum: the signal number (`signal.SIGINT` or `signal.SIGTERM`).
        epoch: int, epochs completed when it stopped.
        step: int, steps completed in the next epoch.
        checkpoint: path of the checkpoint to resume from, or None (no
            `checkpoint_dir`).
        exit_code: 128 + signum (130 for Ctrl-C, 143 for SIGTERM).
    """

    def __init__(self, signum, epoch, step, checkpoint):
        self.signum = signum
        self.epoch = epoch
        self.step = step
        self.checkpoint = checkpoint
        self.exit_code = 128 + int(signum)
        where = f"after epoch {epoch}" + (f", step {step}" if step else "")
        saved = (f"; state saved in {checkpoint}: run it again with the same "
                 "checkpoint directory to resume" if checkpoint else
                 "; no checkpoint_dir, so nothing was saved")
        super().__init__(
            f"training stopped by {_SIGNAL_NAMES.get(signum, signum)} {where}{saved}")


class NonFiniteLossError(ValueError):
    """The training loss became NaN or inf (nothing was saved after it)."""


def log_stderr(message):
    print(f"[keras-vmoe] {message}", file=sys.stderr, flush=True)


class StopSignals:
    """Context manager turning SIGINT/SIGTERM into a stop request (`signum`).

    A second signal raises `KeyboardInterrupt` at once. Installed only from
    the main thread (the only one Python lets install signal handlers).
    """

    def __init__(self, log=log_stderr):
        self.signum = None
        self._log = log
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        self._log(f"{_SIGNAL_NAMES.get(signum, signum)} received: stopping after "
                  "the current step (send it again to abort at once)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _groups(model):
    optimizer = model.optimizer
    return {
        "model": list(model.variables),
        "optimizer": list(optimizer.variables) if optimizer is not None else [],
        "metrics": list(getattr(model, "metrics_variables", [])),
    }


def capture_state(model, with_metrics=False):
    """The model and optimizer state as `(arrays, layout)` NumPy copies."""
    sync_jax_state(model)  # JAX's `fit` holds the values in a detached state
    arrays, layout = {}, {}
    for group, variables in _groups(model).items():
        if group == "metrics" and not with_metrics:
            continue
        layout[group] = [[v.path, list(v.shape)] for v in variables]
        for i, variable in enumerate(variables):
            arrays[f"{group}/{i:05d}"] = np.array(keras.ops.convert_to_numpy(variable))
    return arrays, layout


def array_limits(model):
    """Array name -> bytes of the variable it restores (bounds a checkpoint's reads)."""
    return {f"{group}/{i:05d}": nbytes(v)
            for group, variables in _groups(model).items()
            for i, v in enumerate(variables)}


def check_layout(model, layout, path, arrays=None, with_metrics=False):
    """Raises `CheckpointError` for another model's checkpoint (other variable
    count or shapes), `DamagedCheckpoint` for missing or misshapen arrays."""
    needed = ["model", "optimizer"] + (["metrics"] if with_metrics else [])
    for group, variables in _groups(model).items():
        if group not in layout:
            if group in needed and variables:
                raise DamagedCheckpoint(f"its layout has no {group!r} variables")
            continue
        stored = layout[group]
        if len(stored) != len(variables):
            raise CheckpointError(
                f"Checkpoint {path} holds {len(stored)} {group} variables, the model "
                f"has {len(variables)}: it belongs to another model. Use another "
                "checkpoint directory or overwrite=True (--overwrite).")
        for i, ((name, shape), variable) in enumerate(zip(stored, variables, strict=True)):
            if tuple(shape) != tuple(variable.shape):
                raise CheckpointError(
                    f"Checkpoint {path}: variable {name} has shape {tuple(shape)}, the "
                    f"model's {variable.path} has {tuple(variable.shape)}. Use another "
                    "checkpoint directory or overwrite=True (--overwrite).")
            if arrays is None:
                continue
            key = f"{group}/{i:05d}"
            if key not in arrays:
                raise DamagedCheckpoint(f"array {key!r} ({name}) is missing")
            if tuple(arrays[key].shape) != tuple(variable.shape):
                raise DamagedCheckpoint(
                    f"array {key!r} ({name}) has shape {tuple(arrays[key].shape)}, its "
                    f"layout says {tuple(variable.shape)}")


def restore_state(model, arrays, groups=("model", "optimizer")):
    for group, variables in _groups(model).items():
        if group not in groups:
            continue
        for i, variable in enumerate(variables):
            key = f"{group}/{i:05d}"
            if key in arrays:
                variable.assign(arrays[key])


def _build(model, train):
    """Builds model, loss, metrics and optimizer from one batch of `train`;
    returns the names of layers still unbuilt, or None.

    Reading exactly one batch here, always, keeps a fresh run and a resumed
    one in step (Keras would read one only when something is unbuilt).
    """
    if hasattr(train, "set_epoch"):  # NumPy pipeline: reading has no side effect
        batch = train[0]
    elif not hasattr(train, "element_spec"):
        return
    else:
        batch = next(iter(train))
    symbolic_build(model, keras.tree.map_structure(np.asarray, batch))
    # Keras then reads a batch at every `fit` call to build these.
    unbuilt = [layer.name for layer in flatten_layers(model) if not layer.built]
    return unbuilt or None


def _data_kind(train, steps_per_epoch):
    """'epochs' (finite tf.data, one iterator per epoch), 'indexed' (the NumPy
    pipeline: batches a function of the epoch), 'stream' or 'other'."""
    if hasattr(train, "set_epoch") and hasattr(train, "skip"):
        return "indexed" if steps_per_epoch in (None, len(train)) else "other"
    if not hasattr(train, "element_spec"):
        return "other"
    import tensorflow as tf

    cardinality = int(train.cardinality())
    if cardinality > 0 and steps_per_epoch in (None, cardinality):
        return "epochs"
    if cardinality == tf.data.INFINITE_CARDINALITY:
        return "stream"
    return "other"


def _floats(logs):
    out = {}
    for key, value in (logs or {}).items():
        with contextlib.suppress(TypeError, ValueError):
            out[key] = float(value)
    return out


class _Run(keras.callbacks.Callback):
    """The state of one `run_training` call, and its callback: checks losses
    and stop requests every step, checkpoints every epoch."""

    def __init__(self, model, store, settings, steps, signals, kind, log):
        super().__init__()
        self._model = model
        self.store = store
        self.settings = settings
        self.steps = steps
        self.signals = signals
        self.kind = kind
        self.log = log
        self.epoch = 0
        self.step = 0
        self.history = []
        self.seconds_before = 0.0
        self.started = time.time()
        self.partial_epoch = None
        self.partial_step = 0
        self.partial_metrics = None
        self.validation_stopped = False
        self.last_checkpoint = None
        self.resumed_from = None
        self.pending_validation = False
        self.data = None  # the dataset the current `fit` call reads

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.kind == "indexed":
            # Keras fetches the epoch's batches after this call: they follow
            # the epoch Keras runs, whichever `fit` call (resumed) this is.
            self.data.set_epoch(epoch)
        self.step = self.partial_step if epoch == self.partial_epoch else 0
        if epoch == self.partial_epoch and self.partial_metrics is not None:
            # Keras reset the metrics just before this call: put back the
            # accumulators of the part of the epoch done before the stop.
            restore_state(self.model, self.partial_metrics, groups=("metrics",))
        self.validation_stopped = False

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        loss = (logs or {}).get("loss")
        if loss is not None:
            value = float(loss)
            if not math.isfinite(value):
                self.fail_non_finite(value)
        if self.signals.signum is not None and not self.model.stop_training:
            self.model.stop_training = True
            if self.step < self.steps:
                self.save_partial()

    def on_test_batch_end(self, batch, logs=None):
        if self.signals.signum is not None:
            self.validation_stopped = True
            self.model.stop_evaluating = True

    def on_epoch_end(self, epoch, logs=None):
        if self.step < self.steps:
            return  # stopped part-way: `save_partial` has the state
        entry = _floats(logs)
        if self.validation_stopped:
            # The resumed run evaluates this epoch again.
            entry = {k: v for k, v in entry.items() if not k.startswith("val_")}
        self.pending_validation = self.validation_stopped
        self.history.append(entry)
        self.save(epoch + 1, 0)
        if self.signals.signum is not None:
            self.model.stop_training = True

    def fit_seconds(self):
        return self.seconds_before + time.time() - self.started

    def save(self, epoch, step, with_metrics=False):
        if self.store is None:
            return
        arrays, layout = capture_state(self.model, with_metrics=with_metrics)
        meta = {"epoch": epoch, "step": step, "global_step": epoch * self.steps + step,
                "steps_per_epoch": self.steps, "settings": self.settings,
                "history": self.history, "fit_seconds": self.fit_seconds(),
                "resumed_from": self.resumed_from,
                "pending_validation": self.pending_validation, "layout": layout}
        try:
            self.last_checkpoint = self.store.save(arrays, meta)
        except OSError as error:
            previous = (f"the previous checkpoint {self.last_checkpoint} is intact"
                        if self.last_checkpoint else "no earlier checkpoint exists")
            raise OSError(
                error.errno,
                f"Cannot write a checkpoint in {self.store.directory} "
                f"({error.strerror or error}); {previous}. Free some space or "
                "choose another directory, then run again to resume.") from None

    def save_partial(self):
        if self.kind in ("epochs", "indexed"):
            self.save(self.epoch, self.step, with_metrics=True)
        else:
            self.log("this input pipeline resumes only at epoch boundaries: the "
                     f"{self.step} steps of epoch {self.epoch + 1} will be redone")

    def fail_non_finite(self, value):
        kept = (f"the last good checkpoint {self.last_checkpoint} was kept"
                if self.last_checkpoint else "no checkpoint was written")
        raise NonFiniteLossError(
            f"The training loss became {value} at epoch {self.epoch + 1}, step "
            f"{self.step} of {self.steps} (global step "
            f"{self.epoch * self.steps + self.step}): the batch of that step holds "
            "non-finite images or labels, or the learning rate is too high. "
            f"Training stopped; {kept} and nothing was saved after it.")

    def history_object(self):
        history = keras.callbacks.History()
        history.set_model(self.model)
        keys = []
        for entry in self.history:
            keys += [k for k in entry if k not in keys]
        history.history = {k: [e.get(k, math.nan) for e in self.history] for k in keys}
        history.epoch = list(range(len(self.history)))
        history.fit_seconds = self.fit_seconds()
        history.resumed_from = self.resumed_from
        return history


def _names_difference(old, new, limit=10):
    """Which class names a run lost and gained (or how their order changed)."""
    def preview(names):
        shown = ", ".join(repr(n) for n in names[:limit])
        return f"[{shown}{', ...' if len(names) > limit else ''}]"

    changes = (("removed", [n for n in old if n not in set(new)]),
               ("added", [n for n in new if n not in set(old)]))
    parts = [f"{what} {preview(names)}" for what, names in changes if names]
    return "; ".join(parts) or (
        f"the same names in another order: {preview(old)} -> {preview(new)}")


def _settings_differences(stored, current, prefix=""):
    if not isinstance(stored, dict):
        stored = {}
    keys = sorted(set(stored) | set(current), key=str)
    differences = []
    for k in keys:
        old, new = stored.get(k), current.get(k)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            differences += _settings_differences(old, new, f"{prefix}{k}.")
        elif isinstance(old, list) and isinstance(new, list) and k == "class_names":
            differences.append(f"{prefix}{k}: {_names_difference(old, new)}")
        else:
            differences.append(f"{prefix}{k}: {old!r} -> {new!r}")
    return differences


def _refuse_other_settings(directory, stored, settings):
    differences = _settings_differences(stored, settings)
    if differences:
        raise CheckpointError(
            f"The checkpoints in {directory} are of a run with other "
            f"settings ({'; '.join(differences)}). Use another checkpoint "
            "directory, or overwrite=True (--overwrite) to start again.")


def check_resumable(checkpoint_dir, settings, keys=None):
    """Refuses a checkpoint directory whose index records other settings.

    Reads the index only; the checkpoint itself is checked again on load.

    Args:
        checkpoint_dir: the run's checkpoint directory.
        settings: the settings of the run about to start (or some of them).
        keys: compare only these top-level keys (default: all of `settings`);
            nested dicts compare only the keys `settings` holds.

    Raises:
        CheckpointError: the recorded settings differ (listed).
    """
    recorded = CheckpointStore(checkpoint_dir).recorded_settings()
    if recorded is None:
        return
    keys = list(settings) if keys is None else list(keys)

    def subset(stored, current):
        if not isinstance(stored, dict) or not isinstance(current, dict):
            return stored
        return {k: subset(stored.get(k), v) for k, v in current.items()}

    stored = {k: subset(recorded.get(k), settings.get(k)) for k in keys}
    _refuse_other_settings(os.path.abspath(checkpoint_dir), stored,
                           {k: settings.get(k) for k in keys})


def run_training(model, train, validation=None, *, epochs, steps_per_epoch,
                 fit_steps_per_epoch=None, checkpoint_dir=None, settings=None,
                 overwrite=False, callbacks=(), verbose="auto", shuffle=True,
                 log=log_stderr):
    """Runs `model.fit` stoppable, checkpointed and exactly resumable.

    Args:
        model: a compiled Keras model.
        train: training data (a `tf.data.Dataset` resumes exactly).
        validation: optional validation data.
        epochs: int, the total number of epochs of the run.
        steps_per_epoch: int, steps in one epoch.
        fit_steps_per_epoch: `steps_per_epoch` to pass to `fit`.
        checkpoint_dir: directory of the checkpoints, or None.
        settings: JSON-serialisable dict; a checkpoint of a run with other
            settings is refused.
        overwrite: bool, discard existing checkpoints and start again.
        callbacks: extra Keras callbacks.
        verbose: `fit` verbosity.
        shuffle: `fit`'s `shuffle`.
        log: callable printing one progress line.

    Returns:
        A `keras.callbacks.History` of the whole run (all pieces), with
        `fit_seconds` and `resumed_from`.

    Raises:
        TrainingInterrupted: after a SIGINT/SIGTERM, once the state is saved.
        NonFiniteLossError: the loss became NaN or inf.
        CheckpointError: the checkpoints are damaged beyond recovery or
            belong to another run.
    """
    settings = dict(settings or {})
    store = CheckpointStore(checkpoint_dir) if checkpoint_dir is not None else None
    if store is not None and not overwrite:
        # Before any batch is read: a run with other settings is refused at once.
        check_resumable(store.directory, settings)
    kind = _data_kind(train, fit_steps_per_epoch)
    unbuilt = _build(model, train)
    signals = StopSignals(log)
    run = _Run(model, store, settings, steps_per_epoch, signals, kind, log)
    start_epoch = start_step = 0
    if store is not None:
        if overwrite:
            store.clear()
        store.prepare()

        def check(arrays, meta, path):
            _refuse_other_settings(store.directory, meta.get("settings", {}), settings)
            if meta["epoch"] > epochs or meta.get("steps_per_epoch") not in (
                    None, steps_per_epoch):
                raise DamagedCheckpoint(
                    f"its record's epoch {meta['epoch']} / steps per epoch "
                    f"{meta.get('steps_per_epoch')} do not fit a run of {epochs} "
                    f"epochs of {steps_per_epoch} steps")
            check_layout(model, meta.get("layout", {}), path, arrays,
                         with_metrics=bool(meta["step"]))

        # After `overwrite`, files the run's index did not list (kept by
        # `clear`) are not this run's: nothing is resumed.
        loaded = None if overwrite else store.load(check=check,
                                                   limits=array_limits(model))
        if loaded is not None:
            arrays, meta, path = loaded
            restore_state(model, arrays)
            start_epoch, start_step = int(meta["epoch"]), int(meta["step"])
            run.history = list(meta.get("history", []))
            run.seconds_before = float(meta.get("fit_seconds", 0.0))
            run.last_checkpoint = path
            if start_step:
                run.partial_epoch, run.partial_step = start_epoch, start_step
                run.partial_metrics = arrays
            if meta.get("pending_validation") and validation is not None and run.history:
                # Stopped during the evaluation of the last finished epoch:
                # evaluate it now (same weights), so the history is whole.
                logs = model.evaluate(validation, verbose=0, return_dict=True)
                run.history[-1].update({f"val_{k}": v for k, v in _floats(logs).items()})
            if start_epoch >= epochs:
                log(f"the run is already complete ({epochs} epochs, checkpoint {path}); "
                    "nothing to train (overwrite=True / --overwrite starts again)")
                return run.history_object()
            run.resumed_from = {"epoch": start_epoch, "step": start_step,
                                "global_step": start_epoch * steps_per_epoch + start_step}
            log(f"resuming from epoch {start_epoch} (step {start_step}; global step "
                f"{run.resumed_from['global_step']}) of {epochs}, checkpoint {path}")
            if not getattr(train, "exact_resume", True) or kind == "other":
                log("note: this input pipeline has random state that checkpoints do "
                    "not hold (RandAugment, MixUp or custom batch layers, or a "
                    "non-tf.data input): the resumed run's data differ from an "
                    "uninterrupted run's")
    fit_args = dict(validation_data=validation, verbose=verbose, shuffle=shuffle,
                    callbacks=[run, *callbacks])
    with signals:
        first = start_epoch
        if kind == "stream":
            train = train.skip(start_epoch * steps_per_epoch)
        elif kind == "epochs":
            # Each new iterator draws the pipeline's next shuffle and
            # augmentation seeds, without reading data.
            for _ in range(start_epoch):
                iter(train)
        if start_step and kind == "epochs" and unbuilt:
            log(f"note: layers {unbuilt} are not built (not in the model's graph), so "
                "Keras reads an extra batch at each `fit`; resuming part-way "
                "through an epoch shifts the data of the next epochs by one "
                "iteration")
        if start_step and kind in ("epochs", "indexed"):
            run.data = train.skip(start_step)
            model.fit(run.data, initial_epoch=start_epoch,
                      epochs=start_epoch + 1, **fit_args)
            first = start_epoch + 1
        run.data = train
        if first < epochs and signals.signum is None:
            model.fit(train, initial_epoch=first, epochs=epochs,
                      steps_per_epoch=fit_steps_per_epoch, **fit_args)
        if signals.signum is not None:
            raise TrainingInterrupted(signals.signum, run.epoch + (run.step >= run.steps),
                                      run.step % run.steps, run.last_checkpoint)
    return run.history_object()
