"""LoRA fine-tuning of ViT / V-MoE backbones and tasks.

`enable_lora(model, rank)` adds low-rank updates (Hu et al., 2021) to attention
projections (and, with `experts=True`, the expert banks) and freezes every other
weight except a task's head. The factors are saved on their own with
`save_lora_weights` and applied to a base preset with `load_lora_weights`.

```python
import keras_vmoe

model = keras_vmoe.models.ImageClassifier(
    keras_vmoe.models.VisionTransformerBackbone(
        image_size=16, patch_size=4, hidden_dim=16, num_layers=2, num_heads=2,
        mlp_dim=32, moe_layers=(1,), moe={"num_experts": 4}),
    num_classes=3)
keras_vmoe.presets.save_to_preset(model, "base")
model.enable_lora(4, experts=True)   # query/value of every block + experts
# ... model.fit(...) trains the LoRA factors and the head only ...
model.save_lora_weights("adapter.lora.npz")
tuned = keras_vmoe.presets.from_preset("base")
tuned.load_lora_weights("adapter.lora.npz")  # enables LoRA with the saved rank
```
"""

import contextlib
import json
import os

import keras
import numpy as np

from keras_vmoe.layers.lora_einsum import LORA_MODES
from keras_vmoe.utils import memory_budget
from keras_vmoe.utils.initialization import skip_initializers
from keras_vmoe.utils.safe_files import check_regular_file
from keras_vmoe.utils.safe_files import read_npy_header
from keras_vmoe.utils.safe_files import write_atomically
from keras_vmoe.utils.validation import check_int

TARGETS = ("query", "key", "value", "out")
DEFAULT_TARGETS = ("query", "value")
FORMAT = "keras_vmoe.lora/2"
# Query/key/value factors A (D, N, r), B (r, K): read when no q/k/v target.
FORMAT_V1 = "keras_vmoe.lora/1"
_CONFIG_KEY = "__lora_config__"


def _backbone(model):
    backbone = getattr(model, "backbone", model)
    # Recognised by the methods LoRA uses: this module sits below `Backbone`.
    if not (isinstance(backbone, keras.Model) and hasattr(backbone, "get_moe_layers")
            and hasattr(backbone, "get_encoder_blocks")):
        raise ValueError(
            "LoRA needs a keras_vmoe VisionTransformerBackbone or a task wrapping "
            f"one. Received: {type(model).__name__}"
        )
    return backbone


def _head(model):
    if model is getattr(model, "backbone", model) or not getattr(model, "num_classes", None):
        return None
    return model.get_layer("head")


def _lora_layers(backbone, targets, experts):
    """The layers `enable_lora` adapts: attention projections, then experts."""
    layers = []
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"encoderblock_{i}")
        layers += [getattr(block.attention, name) for name in targets]
        if experts and block.is_moe:
            layers.append(block.moe_layer.experts)
    return layers


def _lora_shape(layer):
    """`(copies, fan_in, fan_out, quantization mode)` of a layer's LoRA matrix."""
    if hasattr(layer, "lora_max_rank"):  # Experts: E matrices (D, M) and (M, D)
        e, d, m = (int(n) for n in layer.kernel_0.shape)
        return e, d, m, layer.quantization_mode
    if not hasattr(layer, "lora_fans"):
        raise ValueError(
            f"LoRA on {layer.path!r} needs a keras_vmoe attention projection "
            f"(LoraEinsumDense); this is a {type(layer).__name__}. Rebuild the model "
            "with this version of keras_vmoe (e.g. load its preset again).")
    fan_in, fan_out = layer.lora_fans()
    return 1, fan_in, fan_out, layer.quantization_mode


def _check_fits(layers, rank):
    """Refuses a rank the layers cannot take, before anything is allocated."""
    nbytes = 0
    for layer in layers:
        copies, fan_in, fan_out, mode = _lora_shape(layer)
        if mode not in LORA_MODES:
            raise ValueError(
                f"LoRA supports float and int8 layers; {layer.path!r} is quantized as "
                f"{mode!r}.")
        if rank > min(fan_in, fan_out):
            raise ValueError(
                f"`rank` must be at most min(fan_in, fan_out) = {min(fan_in, fan_out)} "
                f"for {layer.path!r} (a {fan_in} × {fan_out} projection"
                + (f", {copies} experts" if copies > 1 else "")
                + f"): a larger rank adds nothing. Received: rank={rank}")
        # A and B of each matrix (both kernels of an expert bank), float32.
        matrices = 2 if hasattr(layer, "lora_max_rank") else 1
        nbytes += 4 * matrices * copies * rank * (fan_in + fan_out)
    memory_budget.check_fits(nbytes, "The LoRA factors", f"rank={rank} on {len(layers)} layers")


def _check_head(model, train_head):
    """`train_head` resolved: `None` trains a float head, not an int8 one."""
    head = _head(model)
    if train_head is not None and not isinstance(train_head, bool):
        raise ValueError(f"`train_head` must be True, False or None. Received: {train_head!r}")
    quantized = head is not None and head.quantization_mode is not None
    if train_head and quantized:
        raise ValueError(
            f"train_head=True, but the head is quantized ({head.quantization_mode}); "
            "its int8 kernel cannot train. Pass train_head=False (or None) to keep it "
            "frozen, or give the model a new float head (e.g. from_preset(..., "
            "num_classes=N)).")
    if train_head is None:
        train_head = head is not None and not quantized
    return bool(train_head)


def lora_config(model):
    """The LoRA settings dict of a backbone or task (`None` if none); LoRA
    enabled on a task's backbone counts for the task, `train_head` resolved."""
    config = getattr(model, "_keras_vmoe_lora", None)
    if config is not None:
        return config
    backbone = getattr(model, "backbone", None)
    config = None if backbone is None else getattr(backbone, "_keras_vmoe_lora", None)
    if config is None or backbone is model:
        return config
    return dict(config, train_head=_check_head(model, None))


def enable_lora(model, rank, lora_alpha=None, targets=DEFAULT_TARGETS, experts=False,
                train_head=None):
    """Adds LoRA factors to a backbone or task and freezes everything else.

    Args:
        model: a built backbone or task.
        rank: int r.
        lora_alpha: float, the update is scaled by `lora_alpha / rank`
            (default `rank`).
        targets: attention projections to adapt, a subset of `TARGETS`.
        experts: bool, also adapt the expert kernels of the MoE blocks.
        train_head: bool, keep a task's `head` trainable (`None`: when its
            kernel is float, not int8).

    Returns:
        `model`; compile it again before training.
    """
    rank = check_int(rank, "rank")
    if lora_alpha is not None and not (
        isinstance(lora_alpha, (int, float)) and np.isfinite(lora_alpha) and lora_alpha > 0
    ):
        raise ValueError(f"`lora_alpha` must be a number > 0. Received: {lora_alpha!r}")
    targets = tuple(targets)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not (targets or experts):
        raise ValueError(
            f"`targets` must be a subset of {TARGETS} (and not empty unless "
            f"experts=True). Received: targets={targets!r}"
        )
    backbone = _backbone(model)
    if lora_config(model) is not None:
        raise ValueError(
            f"LoRA is already enabled on this model ({lora_config(model)}); it can be "
            "enabled once."
        )
    if experts and not backbone.moe_layers:
        raise ValueError("experts=True needs MoE blocks; this backbone is dense.")
    train_head = _check_head(model, train_head)
    layers = _lora_layers(backbone, targets, experts)
    _check_fits(layers, rank)
    for layer in layers:
        layer.enable_lora(rank, lora_alpha=lora_alpha)
    config = {"rank": rank, "lora_alpha": rank if lora_alpha is None else lora_alpha,
              "targets": list(targets), "experts": bool(experts),
              "train_head": bool(train_head)}
    object.__setattr__(model, "_keras_vmoe_lora", config)
    if backbone is not model:
        object.__setattr__(backbone, "_keras_vmoe_lora", config)
    return set_lora_trainable(model)


def _is_float(variable):
    return np.dtype(str(variable.dtype)).kind == "f" or "float" in str(variable.dtype)


def set_lora_trainable(model, train_factors=True):
    """Makes only the LoRA factors (and a trained head) of `model` trainable
    and returns it; `train_factors=False` freezes the factors too."""
    config = lora_config(model)
    if config is None:
        raise ValueError("LoRA is not enabled on this model; call enable_lora first.")
    head = _head(model) if config["train_head"] else None
    head_paths = {v.path for v in head.weights} if head is not None else set()
    # Layer-level flags first (they set every float variable).
    model.trainable = True
    for variable in model.weights:
        variable.trainable = _is_float(variable) and (
            ("lora_kernel" in variable.path and train_factors)
            or (variable.path in head_paths and not variable.path.endswith("_scale")))
    backbone = _backbone(model)
    if hasattr(backbone, "reset_compiled_functions"):
        backbone.reset_compiled_functions()
    return model


def lora_weights(model, include_head=True):
    """`{path: numpy array}` of the LoRA factors (and the head)."""
    if lora_config(model) is None:
        raise ValueError("LoRA is not enabled on this model; call enable_lora first.")
    values = {v.path: keras.ops.convert_to_numpy(v.value)
              for v in model.weights if "lora_kernel" in v.path}
    head = _head(model) if include_head else None
    if head is not None:
        values.update({v.path: keras.ops.convert_to_numpy(v.value) for v in head.weights})
    return values


def save_lora_weights(model, path, include_head=True):
    """Writes the LoRA factors (and a task's head) and the settings to one
    `.npz` (suffix added when missing), atomically; returns its absolute path."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    path = os.path.abspath(path)
    values = lora_weights(model, include_head)
    config = dict(lora_config(model), format=FORMAT)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"save_lora_weights: no directory {directory!r}.")

    def write(temporary):
        with open(temporary, "wb") as file:
            np.savez(file, **{_CONFIG_KEY: np.array(json.dumps(config))}, **values)

    return write_atomically(path, write)


class LoraFileError(ValueError):
    """A LoRA file that cannot be applied (names the file and the problem)."""


_CONFIG_MAX_BYTES = 1 << 20
_QKV = ("query", "key", "value")


def _member_header(archive, name):
    """`(shape, dtype)` of an `.npy` member, read without its data."""
    with archive.open(name) as member:
        shape, _, dtype = read_npy_header(member)
    return tuple(shape), np.dtype(dtype)


def _read_member(archive, name):
    with archive.open(name) as member:
        return np.lib.format.read_array(member, allow_pickle=False)


def _read_config(path, archive, names):
    """The LoRA settings stored in the file, checked."""
    member = _CONFIG_KEY + ".npy"
    if member not in names:
        raise LoraFileError(f"{path} has no LoRA settings ({_CONFIG_KEY}); was it written "
                            "by save_lora_weights?")
    if archive.getinfo(member).file_size > _CONFIG_MAX_BYTES:
        raise LoraFileError(f"{path}: {_CONFIG_KEY} is larger than "
                            f"{_CONFIG_MAX_BYTES} bytes; not a LoRA settings record.")
    try:
        raw = _read_member(archive, member)
        if raw.ndim != 0 or raw.dtype.kind not in "US":
            raise ValueError(f"a {raw.dtype} array of shape {raw.shape}, not one string")
        config = json.loads(str(raw))
    except ValueError as error:  # JSONDecodeError is a ValueError
        raise LoraFileError(f"{path}: {_CONFIG_KEY} is not a JSON record of LoRA "
                            f"settings ({error}).") from error
    if not isinstance(config, dict):
        raise LoraFileError(f"{path}: {_CONFIG_KEY} must be a JSON object; it is a "
                            f"{type(config).__name__}.")
    version = config.pop("format", None)
    if version not in (FORMAT, FORMAT_V1):
        raise LoraFileError(f"{path} is not a {FORMAT} file (format {version!r}).")
    required = {"rank", "lora_alpha", "targets", "experts"}
    missing = sorted(required - set(config))
    if missing:
        raise LoraFileError(f"{path}: the LoRA settings lack {missing}.")
    unknown = sorted(set(config) - required - {"train_head"})
    if unknown:
        raise LoraFileError(f"{path}: unknown LoRA settings {unknown}.")
    try:
        check_int(config["rank"], "rank")
        alpha = config["lora_alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
                np.isfinite(alpha) and alpha > 0):
            raise ValueError(f"`lora_alpha` must be a number > 0. Received: {alpha!r}")
        targets = config["targets"]
        if not isinstance(targets, list) or not set(map(str, targets)) <= set(TARGETS) \
                or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"`targets` must be a list of {TARGETS}. Received: {targets!r}")
        for key in ("experts", "train_head"):
            if key in config and not isinstance(config[key], bool):
                raise ValueError(f"`{key}` must be true or false. Received: {config[key]!r}")
    except ValueError as error:
        raise LoraFileError(f"{path}: {error}") from None
    if version == FORMAT_V1 and set(config["targets"]) & set(_QKV):
        raise LoraFileError(
            f"{path} was written in the old {FORMAT_V1} layout (query/key/value "
            f"factors A (D, N, r), B (r, K)); this version ({FORMAT}, A (D, r), "
            "B (r, N, K)) cannot apply it. Merge it with the version that wrote it "
            "(load_lora_weights, then save_to_preset) and load that preset instead.")
    return config


def _check_array(path, key, shape, dtype, model_shape, model_dtype):
    if tuple(shape) != tuple(model_shape):
        raise LoraFileError(
            f"{path}: shape mismatch for {key!r}: file {tuple(shape)}, model "
            f"{tuple(model_shape)}.")
    target = np.dtype(model_dtype)
    if not (dtype.kind == "f" if target.kind == "f" else dtype == target):
        raise LoraFileError(
            f"{path}: {key!r} is {dtype}; the model's weight is {target}"
            + (" (real floating point)." if target.kind == "f" else "."))


def load_lora_weights(model, path):
    """Loads LoRA factors (and a head) saved by `save_lora_weights`.

    Enables LoRA with the saved settings when the model has none (else they
    must match). Every array is checked before any weight is assigned.

    Returns `model`; raises `FileNotFoundError` or `LoraFileError` (a
    `ValueError` naming the file and what is wrong).
    """
    import zipfile

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_lora_weights: no file {path!r}.")
    check_regular_file(path, "LoRA .npz file", LoraFileError)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as error:
        raise LoraFileError(f"{path} is not a readable LoRA .npz file ({error}).") from error
    with archive:
        names = set(archive.namelist())
        config = _read_config(path, archive, names)
        config.setdefault("train_head", True)
        keys = {name[:-4]: name for name in names if name.endswith(".npy")}
        keys.pop(_CONFIG_KEY)
        others = sorted(set(names) - set(keys.values()) - {_CONFIG_KEY + ".npy"})
        if others:
            raise LoraFileError(f"{path}: unexpected members {others[:5]}.")
        head = _head(model)
        head_variables = {v.path: v for v in head.weights} if head is not None else {}
        foreign = sorted(k for k in keys
                         if "lora_kernel" not in k and k not in head_variables)
        if foreign:
            raise LoraFileError(
                f"{path} holds {foreign[:5]}, which are neither LoRA factors nor the "
                "head's weights; a LoRA file may set only those.")
        try:
            headers = {key: _member_header(archive, name) for key, name in keys.items()}
        except (OSError, ValueError, zipfile.BadZipFile) as error:
            raise LoraFileError(f"{path}: unreadable array ({error}).") from error
        current = lora_config(model)
        compared = ("rank", "lora_alpha", "targets", "experts")
        if current is not None and any(current[k] != config[k] for k in compared):
            raise LoraFileError(
                f"The model's LoRA settings {current} differ from the file's {config} "
                f"({path}).")
        backbone = _backbone(model)
        layers = _lora_layers(backbone, config["targets"], config["experts"])
        if config["experts"] and not backbone.moe_layers:
            raise LoraFileError(f"{path} adapts experts; this backbone is dense.")
        try:
            _check_fits(layers, config["rank"])  # before any shape is built
        except ValueError as error:
            raise LoraFileError(f"{path}: {error}") from error
        expected = {f"{layer.path}/{name}": (shape, "float32")
                    for layer in layers
                    for name, shape in layer.lora_factor_shapes(config["rank"]).items()}
        stored = {p for p in keys if "lora_kernel" in p}
        if set(expected) != stored:
            raise LoraFileError(
                f"{path} does not match the model's LoRA weights: missing "
                f"{sorted(set(expected) - stored)[:5]}, unexpected "
                f"{sorted(stored - set(expected))[:5]}.")
        expected.update({p: (tuple(v.shape), str(v.dtype))
                         for p, v in head_variables.items()})
        for key, (shape, dtype) in headers.items():
            _check_array(path, key, shape, dtype, *expected[key])
        values = {}
        for key, name in keys.items():
            try:
                value = _read_member(archive, name)
            except (OSError, ValueError, zipfile.BadZipFile) as error:
                raise LoraFileError(f"{path}: unreadable array {key!r} ({error}).") from error
            if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
                raise LoraFileError(f"{path}: {key!r} holds non-finite values (NaN or inf).")
            values[key] = value
    # The file holds every factor: they are not drawn from their initializers.
    scope = skip_initializers() if current is None else contextlib.nullcontext()
    with scope as skipped:
        if current is None:
            enable_lora(model, config["rank"], lora_alpha=config["lora_alpha"],
                        targets=config["targets"], experts=config["experts"],
                        train_head=None if config["train_head"] else False)
        variables = {v.path: v for v in model.weights}
        for key, value in values.items():
            variables[key].assign(value.astype(str(variables[key].dtype)))
    if skipped is not None:
        skipped.check_assigned(model, source=path)
    return model


def trainable_parameter_count(model):
    """Number of trainable weights of `model` (e.g. after `enable_lora`)."""
    return int(sum(np.prod(v.shape) for v in model.trainable_weights))
