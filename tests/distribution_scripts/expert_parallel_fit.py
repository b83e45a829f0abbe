"""A few expert-parallel fit steps over 8 devices; writes the losses as JSON.

Run as one process with 8 devices, or under `keras-vmoe launch` as several
processes, each feeding its own rows of every global batch.

    python expert_parallel_fit.py OUT_DIR
"""

import json
import os
import sys

from keras_vmoe import distribution

process_id, num_processes = distribution.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_vmoe.models.image_classifier import ImageClassifier  # noqa: E402
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tiny_configs  # noqa: E402  (tests/tiny_configs.py)

CONFIG = tiny_configs.expert_parallel_8px(num_layers=1, moe_layers=(0,))
BATCH, STEPS = 16, 3

mesh = distribution.make_mesh(data=2, expert=4)
keras.distribution.set_distribution(
    distribution.make_distribution("expert", mesh, config=CONFIG, batch_size=BATCH,
                                   auto_shard_dataset=False))
keras.utils.set_random_seed(0)
model = ImageClassifier(VisionTransformerBackbone(**CONFIG), num_classes=3, compile=False)
model.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

rng = np.random.default_rng(0)
x = rng.uniform(-1, 1, size=(STEPS * BATCH, 8, 8, 3)).astype("float32")
y = np.arange(STEPS * BATCH) % 3
# This process's rows of every global batch: the global batch is split over
# the devices in mesh order, and process p owns devices [p*L, (p+1)*L).
local = BATCH // num_processes
rows = np.concatenate([np.arange(s * BATCH + process_id * local,
                                 s * BATCH + (process_id + 1) * local) for s in range(STEPS)])
losses = []
model.fit(x[rows], y[rows], batch_size=local, epochs=1, shuffle=False, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(
              on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))])
out = os.path.join(sys.argv[1], f"losses_{process_id}_of_{num_processes}.json")
with open(out + ".tmp", "w") as f:
    json.dump({"losses": losses, "devices": len(keras.distribution.list_devices())}, f)
os.replace(out + ".tmp", out)
