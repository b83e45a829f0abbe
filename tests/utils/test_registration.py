"""keras_vmoe/utils/registration.py: a `.keras` file of a keras_vmoe model
loads in a fresh process after `import keras_vmoe` alone, whichever of Keras
and keras_vmoe is imported first, and prints no optimizer warning."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tiny_configs

LOAD = """
{imports}
import numpy as np
m = keras.saving.load_model({path!r})
np.save({out!r}, m.predict(np.zeros((2, 16, 16, 3), "float32"), verbose=0))
print(type(m).__name__, m.optimizer.built)
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keras_files")
    model = tiny_configs.vmoe_16px_classifier()
    images = np.zeros((2, 16, 16, 3), "float32")
    expected = {"untrained": model.predict(images, verbose=0)}
    model.save(folder / "untrained.keras")
    model.fit(np.zeros((4, 16, 16, 3), "float32"), np.zeros(4), verbose=0)
    model.save(folder / "trained.keras")
    expected["trained"] = model.predict(images, verbose=0)
    return folder, expected


@pytest.mark.parametrize("imports", ["import keras, keras_vmoe", "import keras_vmoe, keras"])
@pytest.mark.parametrize("name, built", [("untrained", False), ("trained", True)])
def test_a_keras_file_loads_after_importing_the_package_alone(saved, imports, name, built):
    folder, expected = saved
    out = folder / f"{name}-{imports[7:12]}.npy"
    code = LOAD.format(imports=imports, path=str(folder / f"{name}.keras"), out=str(out))
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONWARNINGS="always")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["ImageClassifier", str(built)]
    assert "Skipping variable loading" not in result.stderr
    np.testing.assert_allclose(np.load(out), expected[name], atol=1e-6)
