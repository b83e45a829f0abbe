"""Runs the backend-parity workload under the current `KERAS_BACKEND`.

`python tests/backends/driver.py OUT.json` writes, for the backend of the
process, the logits of every converted upstream fixture (and of a preset
saved and reloaded from one), and the losses of a few training steps of
converted models (`fit` with the fixture grouping and with the default
grouping, `evaluate`, and `keras_vmoe.training.finetune`). The tests in
`test_backends.py` run it once under JAX and once under the backend of the
test process and compare the two.

The weights come from the upstream checkpoints, so they are identical on
every backend; router noise and dropout (random numbers differ between
backends) are switched off for the training steps.
"""

import json
import os
import pathlib
import sys
import tempfile

UPSTREAM = pathlib.Path(__file__).resolve().parents[1] / "data" / "upstream_vmoe"
# (fixture, variant) of every upstream fixture.
CASES = (
    ("vmoe_tiny", "f32dispatch"),
    ("vmoe_tiny", "bf16dispatch"),
    ("vmoe_tiny_ec", "f32dispatch"),
    ("vmoe_tiny_ec", "bf16dispatch"),
    ("vmoe_tiny_ec", "round1_bf16dispatch"),
    ("eee_tiny", "f32dispatch"),
    ("eee_tiny", "bf16dispatch"),
    ("softmoe_tiny", "main"),
)
# Converted models trained for a few steps: (fixture, variant, grouping).
FIT_CASES = (
    ("vmoe_tiny", "f32dispatch", "fixture"),
    ("vmoe_tiny", "f32dispatch", "all"),
    ("vmoe_tiny_ec", "f32dispatch", "fixture"),
    ("eee_tiny", "f32dispatch", "fixture"),
    ("softmoe_tiny", "main", "fixture"),
)


def routing_of(fixture, variant):
    """Converter routing arguments of a fixture variant (as upstream's)."""
    from keras_vmoe.conversion import routing_from_upstream_config

    config = json.loads((UPSTREAM / fixture / "config.json").read_text())
    return routing_from_upstream_config(config["variants"][variant]["model_config"],
                                        image_size=32)


def convert(fixture, variant):
    from keras_vmoe.conversion import build_model_from_upstream

    return build_model_from_upstream(
        str(UPSTREAM / fixture / "checkpoint"), **routing_of(fixture, variant)
    )


def inputs(fixture):
    import numpy as np

    return np.load(UPSTREAM / fixture / "inputs.npy")


def _deterministic(model):
    """No router noise, no dropout: the same numbers on every backend."""
    from keras_vmoe.layers import MoeLayer

    for layer in model._flatten_layers():
        if isinstance(layer, MoeLayer) and hasattr(layer.router, "noise_std"):
            layer.router.noise_std = 0.0
        if hasattr(layer, "rate") and "dropout" in type(layer).__name__.lower():
            layer.rate = 0.0


def logits_of_fixtures():
    import numpy as np

    out = {}
    for fixture, variant in CASES:
        model = convert(fixture, variant)
        out[f"{fixture}-{variant}"] = np.asarray(
            model.predict_on_batch(inputs(fixture)), "float64"
        ).tolist()
    return out


def preset_round_trip():
    """Logits of a converted fixture saved as a preset and reloaded."""
    import numpy as np

    import keras_vmoe

    model = convert("vmoe_tiny", "f32dispatch")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vmoe_tiny")
        keras_vmoe.presets.save_to_preset(model, path)
        loaded = keras_vmoe.presets.from_preset(path)
        return np.asarray(loaded.predict_on_batch(inputs("vmoe_tiny")), "float64").tolist()


def fit_losses(fixture, variant, grouping):
    import keras
    import numpy as np

    model = convert(fixture, variant)
    _deterministic(model)
    if grouping == "all":
        for layer in _moe_layers(model):
            layer.set_routing(group_size=None, images_per_group=None)
    x = inputs(fixture)
    y = np.arange(len(x)) % 10
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    # Batches of 3 then 1 image: a partial last batch (another group count,
    # and with the default grouping another group size and capacity).
    history = model.fit(x, y, batch_size=3, epochs=3, shuffle=False, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)
    return {"fit": [float(v) for v in history.history["loss"]],
            "evaluate": float(evaluated["loss"])}


def _moe_layers(model):
    from keras_vmoe.layers import MoeLayer

    return [layer for layer in model._flatten_layers() if isinstance(layer, MoeLayer)]


def finetune_losses():
    """`keras_vmoe.training.finetune` (upstream's fine-tuning recipe)."""
    import numpy as np
    import tensorflow as tf

    import keras_vmoe

    model = convert("vmoe_tiny", "f32dispatch")
    _deterministic(model)
    x = inputs("vmoe_tiny")
    y = np.arange(len(x)) % 10
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    history = keras_vmoe.training.finetune(
        model, train, epochs=2, learning_rate=0.05, verbose=0, log=lambda *a: None
    )
    return [float(v) for v in history.history["loss"]]


def run(sections=("logits", "preset", "fit", "finetune")):
    import keras

    out = {"backend": keras.config.backend()}
    if "logits" in sections:
        out["logits"] = logits_of_fixtures()
    if "preset" in sections:
        out["preset"] = preset_round_trip()
    if "fit" in sections:
        out["fit"] = {"-".join(case): fit_losses(*case) for case in FIT_CASES}
    if "finetune" in sections:
        out["finetune"] = finetune_losses()
    return out


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    sections = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    result = run(sections) if sections else run()
    pathlib.Path(sys.argv[1]).write_text(json.dumps(result))
