"""ViT checkpoints of timm, Hugging Face transformers and KerasHub as keras_vmoe models.

`detect_source` names a checkpoint's library, `read_spec` turns its configs
into a `HubVitSpec` (or refuses a feature the backbone cannot express) and
`read_weights` maps its weights, the source's input normalisation folded
into the patch embedding (keras_vmoe models take images in [-1, 1]).
"""

import dataclasses
import os
import re

import numpy as np

from keras_vmoe.conversion.timm_archs import ARCHITECTURES as TIMM_ARCHITECTURES
from keras_vmoe.formats import safetensors

SOURCES = ("timm", "transformers", "keras_hub")
SAFETENSORS_FILE = "model.safetensors"
HF_PREPROCESSOR_FILE = "preprocessor_config.json"
KERAS_HUB_FILES = ("model.weights.h5", "task.json", "task.weights.h5", "preprocessor.json")
# PIL's resampling codes (transformers' `resample`) -> Keras interpolation.
_PIL_INTERPOLATION = {0: "nearest", 2: "bilinear", 3: "bicubic", 1: "lanczos3"}
_TIMM_DEFAULTS = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
                  "interpolation": "bicubic"}


class UnsupportedHubVitError(ValueError):
    """A checkpoint uses a feature `VisionTransformerBackbone` cannot express."""


@dataclasses.dataclass
class HubVitSpec:
    """What a source checkpoint becomes, known from its configs alone.

    Attributes:
        backbone: `VisionTransformerBackbone` arguments.
        num_classes: head size, or `None` for a backbone without head.
        input_scale, input_offset: per-channel `a`, `b` with the source's
            input `a·v + b` for keras_vmoe's input `v` in [-1, 1].
        activation: the head's activation (KerasHub), `None` for logits.
        options: source-specific facts the weight mapping needs.
    """

    source: str
    backbone: dict
    num_classes: int | None
    input_scale: tuple
    input_offset: tuple
    interpolation: str = "bilinear"
    class_names: list | None = None
    activation: str | None = None
    options: dict = dataclasses.field(default_factory=dict)


def detect_source(config):
    """The library (`"timm"`, `"transformers"`, `"keras_hub"`) a parsed
    `config.json` comes from, or `None` (e.g. a keras_vmoe preset)."""
    if not isinstance(config, dict):
        return None
    if "architecture" in config and ("pretrained_cfg" in config
                                     or "num_features" in config):
        return "timm"
    if isinstance(config.get("model_type"), str):
        return "transformers"
    registered = str(config.get("registered_name") or "")
    module = str(config.get("module") or "")
    if registered.startswith("keras_hub>") or module.startswith("keras_hub."):
        return "keras_hub"
    return None


def weight_files(source, spec=None):
    """`(required, optional)` file names a source's checkpoint loads from."""
    del spec
    if source == "keras_hub":
        return ("model.weights.h5",), KERAS_HUB_FILES[1:]
    if source == "transformers":
        return (SAFETENSORS_FILE,), (HF_PREPROCESSOR_FILE,)
    return (SAFETENSORS_FILE,), ()


def _refuse(where, feature, hint=""):
    raise UnsupportedHubVitError(
        f"{where} uses {feature}, which keras_vmoe's VisionTransformerBackbone "
        f"cannot express; it cannot be loaded.{(' ' + hint) if hint else ''}")


def _normalization(mean, std, rescale=1 / 255):
    """Per-channel `(a, b)`: the source input `(v+1)·127.5·rescale - mean) / std`."""
    mean = np.asarray(mean, "float64").reshape(-1)
    std = np.asarray(std, "float64").reshape(-1)
    scale = 127.5 * rescale / std
    return tuple(float(v) for v in scale), tuple(
        float(v) for v in (127.5 * rescale - mean) / std)


# timm `VisionTransformer` arguments and the feature each names when it is
# set to something other than its default (or a value in `_TIMM_OFF`).
_TIMM_FEATURES = {
    "init_values": "layer scale (`init_values`)",
    "reg_tokens": "register tokens (`reg_tokens`)",
    "pre_norm": "a pre-norm LayerNorm before the encoder (`pre_norm`, as CLIP)",
    "qk_norm": "qk-norm (`qk_norm`)",
    "block_fn": "another block type (`block_fn`)",
    "mlp_layer": "another MLP (`mlp_layer`, e.g. SwiGLU)",
    "attn_layer": "another attention (`attn_layer`)",
    "embed_norm_layer": "a norm in the patch embedding (`embed_norm_layer`)",
    "scale_attn_norm": "a norm inside attention (`scale_attn_norm`)",
    "scale_mlp_norm": "a norm inside the MLP (`scale_mlp_norm`)",
    "distilled": "a distillation token (DeiT distilled)",
    "pool_include_prefix": "pooling over the class token (`pool_include_prefix`)",
    "final_norm": "no final LayerNorm (`final_norm=False`)",
    "pos_embed": "a position embedding other than learned (`pos_embed`)",
    "rope": "rotary position embeddings",
    "attn_pool_num_heads": "attention pooling (`global_pool='map'`)",
}
_TIMM_OFF = {"init_values": (None,), "reg_tokens": (None, 0), "pre_norm": (None, False),
             "qk_norm": (None, False), "distilled": (None, False),
             "pool_include_prefix": (None, False), "final_norm": (None, True),
             "pos_embed": (None, "learn"), "scale_attn_norm": (None, False),
             "scale_mlp_norm": (None, False)}
_TIMM_EPSILON = {None: 1e-6, "<partial(LayerNorm, eps=1e-05)>": 1e-5,
                 "<nn.LayerNorm>": 1e-5, "layernorm": 1e-5}
_TIMM_ACTIVATION = {None: "gelu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


def _timm_arguments(config, where):
    arch = config.get("architecture")
    if arch not in TIMM_ARCHITECTURES:
        family = str(arch).split("_")[0]
        raise UnsupportedHubVitError(
            f"{where}: timm architecture {arch!r} is not one of timm's plain "
            "VisionTransformer factories (`vit_*`, `deit_*` of "
            "timm/models/vision_transformer.py and deit.py) that keras_vmoe maps"
            + (f" ({family!r} models are another architecture)" if family not in (
                "vit", "deit") else "") + ".")
    args = dict(TIMM_ARCHITECTURES[arch])
    args.update(config.get("model_args") or {})
    for key in ("num_classes", "global_pool"):
        if key in config:
            args.setdefault(key, config[key])
    return arch, args


def _timm_check(args, where):
    found = [feature for key, feature in _TIMM_FEATURES.items()
             if args.get(key) is not None and args.get(key) not in _TIMM_OFF.get(key, ())]
    if found:
        _refuse(where, ", ".join(found))
    if args.get("_deit") and args.get("distilled"):
        _refuse(where, _TIMM_FEATURES["distilled"])
    activation = args.get("act_layer")
    if activation not in _TIMM_ACTIVATION:
        _refuse(where, f"the MLP activation {activation!r}",
                "Supported: exact GELU (timm's default) and 'gelu_tanh'.")
    if args.get("norm_layer") not in _TIMM_EPSILON:
        _refuse(where, f"the norm layer {args['norm_layer']!r} (not a LayerNorm)")
    pool = args.get("global_pool", "token") or "token"
    class_token = args.get("class_token", True) is not False
    if pool == "map":
        _refuse(where, _TIMM_FEATURES["attn_pool_num_heads"])
    if pool not in ("token", "avg"):
        _refuse(where, f"the pooling global_pool={pool!r}")
    if pool == "avg" and args.get("fc_norm") is not False:
        _refuse(where, "a LayerNorm after average pooling (`fc_norm`)",
                "keras_vmoe's 'gap' pools the normalised tokens (fc_norm=False).")
    if pool == "avg" and class_token:
        _refuse(where, "average pooling with a class token")
    if pool == "token" and not class_token:
        _refuse(where, "token pooling without a class token")
    return pool, class_token


def _timm_spec(config, where):
    arch, args = _timm_arguments(config, where)
    pool, class_token = _timm_check(args, where)
    pretrained = config.get("pretrained_cfg") or {}
    image_size = args.get("img_size") or (pretrained.get("input_size") or [3, 224, 224])[1:]
    image_size = [int(image_size)] * 2 if isinstance(image_size, int) else [
        int(v) for v in image_size]
    patch = args.get("patch_size", 16)
    embed_dim = int(args["embed_dim"])
    backbone = dict(
        image_size=tuple(image_size) if image_size[0] != image_size[1] else image_size[0],
        patch_size=patch, hidden_dim=embed_dim, num_layers=int(args["depth"]),
        num_heads=int(args["num_heads"]),
        mlp_dim=int(embed_dim * float(args.get("mlp_ratio", 4.0))),
        classifier="token" if pool == "token" else "gap",
        num_channels=int(args.get("in_chans", 3)),
        mlp_activation=_TIMM_ACTIVATION[args.get("act_layer")],
        layer_norm_epsilon=_TIMM_EPSILON[args.get("norm_layer")])
    num_classes = int(args.get("num_classes", pretrained.get("num_classes", 1000)) or 0)
    scale, offset = _normalization(pretrained.get("mean", _TIMM_DEFAULTS["mean"]),
                                   pretrained.get("std", _TIMM_DEFAULTS["std"]))
    names = pretrained.get("label_names")
    return HubVitSpec(
        "timm", backbone, num_classes or None, scale, offset,
        interpolation=pretrained.get("interpolation", "bicubic"),
        class_names=list(names) if isinstance(names, list) and len(
            names) == num_classes else None,
        options={"architecture": arch,
                 "no_embed_class": bool(args.get("no_embed_class")) and class_token})


def _timm_weights(tensors, spec):
    """keras_vmoe weight path -> array, from a timm state dict."""
    out = {"patch_embedding/kernel": np.transpose(tensors.pop("patch_embed.proj.weight"),
                                                  (2, 3, 1, 0)),
           "patch_embedding/bias": tensors.pop("patch_embed.proj.bias", None),
           "encoder_norm/gamma": tensors.pop("norm.weight"),
           "encoder_norm/beta": tensors.pop("norm.bias")}
    pos = tensors.pop("pos_embed")
    if "cls_token" in tensors:
        out["patch_embedding/cls"] = tensors.pop("cls_token")
        if spec.options.get("no_embed_class"):  # the class token gets no position
            pos = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
    out["position_embedding/embedding"] = pos
    heads = spec.backbone["num_heads"]
    for i in range(spec.backbone["num_layers"]):
        src, dst = f"blocks.{i}.", f"encoderblock_{i}/"
        qkv = tensors.pop(src + "attn.qkv.weight")
        qkv_bias = tensors.pop(src + "attn.qkv.bias", None)
        for j, name in enumerate(("query", "key", "value")):
            width = qkv.shape[0] // 3
            bias = None if qkv_bias is None else qkv_bias[j * width:(j + 1) * width]
            out.update(_attention_projection(dst + "attention/" + name,
                                             qkv[j * width:(j + 1) * width], bias, heads))
        out.update(_attention_output(dst + "attention/out", tensors.pop(
            src + "attn.proj.weight"), tensors.pop(src + "attn.proj.bias", None), heads))
        for a, b in (("norm1", "layer_norm_0"), ("norm2", "layer_norm_1")):
            out[dst + b + "/gamma"] = tensors.pop(src + a + ".weight")
            out[dst + b + "/beta"] = tensors.pop(src + a + ".bias")
        for a, b in (("mlp.fc1", "mlp/dense_0"), ("mlp.fc2", "mlp/dense_1")):
            out.update(_dense(dst + b, tensors.pop(src + a + ".weight"),
                              tensors.pop(src + a + ".bias", None)))
    if spec.num_classes:
        out.update(_dense("head", tensors.pop("head.weight"), tensors.pop("head.bias", None)))
    tensors.pop("fc_norm.weight", None), tensors.pop("fc_norm.bias", None)
    return out


_HF_ACTIVATION = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_HF_ARCHITECTURES = ("ViTForImageClassification", "ViTModel")
_HF_OTHER_TYPES = {
    "deit": "DeiT's distillation token", "dinov2": "layer scale (DINOv2)",
    "dinov2_with_registers": "register tokens (DINOv2 with registers)",
    "beit": "relative position biases (BEiT)", "data2vec-vision": "relative position "
    "biases (data2vec-vision)", "vit_hybrid": "a convolutional stem (ViT hybrid)",
    "siglip_vision_model": "attention pooling (SigLIP)",
    "clip_vision_model": "a pre-norm LayerNorm and quick GELU (CLIP)",
}


def _hf_spec(config, preprocessor, where):
    model_type = config.get("model_type")
    if model_type != "vit":
        _refuse(where, _HF_OTHER_TYPES.get(model_type, f"the model_type {model_type!r}"),
                "keras_vmoe loads transformers checkpoints of model_type 'vit'.")
    architectures = config.get("architectures") or ["ViTModel"]
    if architectures[0] not in _HF_ARCHITECTURES:
        _refuse(where, f"the architecture {architectures[0]!r}",
                f"Supported: {list(_HF_ARCHITECTURES)}.")
    activation = config.get("hidden_act", "gelu")
    if activation not in _HF_ACTIVATION:
        _refuse(where, f"the activation hidden_act={activation!r}")
    if config.get("pooler_act", "tanh") != "tanh":
        _refuse(where, f"the pooler activation {config['pooler_act']!r}")
    hidden = int(config.get("hidden_size", 768))
    backbone = dict(
        image_size=_pair_or_int(config.get("image_size", 224)),
        patch_size=_pair_or_int(config.get("patch_size", 16)), hidden_dim=hidden,
        num_layers=int(config.get("num_hidden_layers", 12)),
        num_heads=int(config.get("num_attention_heads", 12)),
        mlp_dim=int(config.get("intermediate_size", 3072)), classifier="token",
        num_channels=int(config.get("num_channels", 3)),
        mlp_activation=_HF_ACTIVATION[activation],
        layer_norm_epsilon=float(config.get("layer_norm_eps", 1e-12)))
    classifier = architectures[0] == "ViTForImageClassification"
    labels = config.get("id2label") or {}
    num_classes = int(config.get("num_labels") or len(labels) or 2) if classifier else None
    pre = preprocessor or {}
    mean = pre.get("image_mean", (0.5,) * 3) if pre.get("do_normalize", True) else (0.0,) * 3
    std = pre.get("image_std", (0.5,) * 3) if pre.get("do_normalize", True) else (1.0,) * 3
    rescale = float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) else 1.0
    scale, offset = _normalization(mean, std, rescale)
    names = [labels.get(str(i)) for i in range(num_classes or 0)]
    return HubVitSpec(
        "transformers", backbone, num_classes, scale, offset,
        interpolation=_PIL_INTERPOLATION.get(pre.get("resample", 2), "bilinear"),
        class_names=names if classifier and all(isinstance(n, str) for n in names)
        and not all(n == f"LABEL_{i}" for i, n in enumerate(names)) else None,
        options={"prefix": "vit." if classifier else "",
                 "pooler_size": config.get("pooler_output_size") or hidden})


def _hf_weights(tensors, spec):
    prefix = spec.options["prefix"]
    if prefix and not any(k.startswith(prefix) for k in tensors):
        prefix = ""
    if not prefix and not spec.num_classes:
        # A ViTModel saved inside another model keeps the `vit.` prefix.
        prefix = "vit." if "vit.embeddings.cls_token" in tensors else ""

    def take(name, *default):
        return tensors.pop(prefix + name, *default)

    emb = "embeddings."
    out = {"patch_embedding/kernel": np.transpose(
               take(emb + "patch_embeddings.projection.weight"), (2, 3, 1, 0)),
           "patch_embedding/bias": take(emb + "patch_embeddings.projection.bias", None),
           "patch_embedding/cls": take(emb + "cls_token"),
           "position_embedding/embedding": take(emb + "position_embeddings"),
           "encoder_norm/gamma": take("layernorm.weight"),
           "encoder_norm/beta": take("layernorm.bias")}
    take(emb + "mask_token", None)
    heads = spec.backbone["num_heads"]
    for i in range(spec.backbone["num_layers"]):
        src, dst = f"encoder.layer.{i}.", f"encoderblock_{i}/"
        for name in ("query", "key", "value"):
            out.update(_attention_projection(
                dst + "attention/" + name, take(f"{src}attention.attention.{name}.weight"),
                take(f"{src}attention.attention.{name}.bias", None), heads))
        out.update(_attention_output(
            dst + "attention/out", take(src + "attention.output.dense.weight"),
            take(src + "attention.output.dense.bias", None), heads))
        for a, b in (("layernorm_before", "layer_norm_0"), ("layernorm_after", "layer_norm_1")):
            out[dst + b + "/gamma"] = take(f"{src}{a}.weight")
            out[dst + b + "/beta"] = take(f"{src}{a}.bias")
        for a, b in (("intermediate.dense", "mlp/dense_0"), ("output.dense", "mlp/dense_1")):
            out.update(_dense(dst + b, take(f"{src}{a}.weight"), take(f"{src}{a}.bias", None)))
    pooler = take("pooler.dense.weight", None), take("pooler.dense.bias", None)
    if spec.num_classes:
        out.update(_dense("head", tensors.pop("classifier.weight"),
                          tensors.pop("classifier.bias", None)))
    elif pooler[0] is not None:
        spec.backbone["representation_size"] = int(pooler[0].shape[0])
        out.update(_dense("pre_logits", *pooler))
    return out


def _keras_hub_spec(config, task, where):
    if config.get("class_name") != "ViTBackbone":
        _refuse(where, f"the KerasHub model {config.get('class_name')!r}",
                "keras_vmoe loads KerasHub `ViTBackbone` presets.")
    args = config.get("config") or {}
    if args.get("data_format") == "channels_first":
        _refuse(where, "channels-first images (`data_format='channels_first'`)")
    height, width, channels = args["image_shape"]
    class_token = args.get("use_class_token", True)
    task_args = (task or {}).get("config") or {}
    pooling = task_args.get("pooling", "token" if class_token else "gap")
    if (pooling == "gap") == bool(class_token):
        _refuse(where, f"{pooling!r} pooling with use_class_token={class_token}",
                "keras_vmoe pools the class token, or the mean of the tokens of a "
                "model without one.")
    backbone = dict(
        image_size=height if height == width else (height, width),
        patch_size=_pair_or_int(args["patch_size"]), hidden_dim=int(args["hidden_dim"]),
        num_layers=int(args["num_layers"]), num_heads=int(args["num_heads"]),
        mlp_dim=int(args["mlp_dim"]), classifier="token" if class_token else "gap",
        num_channels=int(channels), mlp_activation="gelu",
        layer_norm_epsilon=float(args.get("layer_norm_epsilon", 1e-6)))
    if task_args.get("intermediate_dim"):
        backbone["representation_size"] = int(task_args["intermediate_dim"])
    pre = (task_args.get("preprocessor") or {}).get("config") or {}
    converter = (pre.get("image_converter") or {}).get("config") or {}
    scale = np.broadcast_to(np.asarray(converter.get("scale", 1 / 255), "float64"), 3)
    offset = np.broadcast_to(np.asarray(converter.get("offset", 0.0) or 0.0, "float64"), 3)
    activation = task_args.get("activation")
    if activation not in (None, "linear", "softmax"):
        _refuse(where, f"the head activation {activation!r}")
    return HubVitSpec(
        "keras_hub", backbone, int(task_args["num_classes"]) if task else None,
        tuple(float(v) for v in 127.5 * scale),
        tuple(float(v) for v in 127.5 * scale + offset),
        interpolation=converter.get("interpolation", "bilinear"),
        activation=None if activation == "linear" else activation)


def _keras_hub_weights(path, spec):
    import h5py  # lazy: a Keras dependency, needed for KerasHub presets only

    def datasets(file_name):
        found = {}
        with h5py.File(os.path.join(path, file_name), "r") as file:
            file.visititems(lambda name, obj: found.__setitem__(name, obj[()])
                            if isinstance(obj, h5py.Dataset) else None)
        return found

    found = datasets("model.weights.h5")
    out = {}
    blocks = {}
    for name, value in found.items():
        match = re.search(r"encoder_layers/([^/]+)/(.+)/vars/(\d+)$", name)
        if match:
            blocks.setdefault(match.group(1), {})[(match.group(2), match.group(3))] = value
        elif re.search(r"patching_and_embedding/patch_embedding/vars/0$", name):
            out["patch_embedding/kernel"] = value
        elif re.search(r"patching_and_embedding/patch_embedding/vars/1$", name):
            out["patch_embedding/bias"] = value
        elif re.search(r"patching_and_embedding/position_embedding/vars/0$", name):
            out["position_embedding/embedding"] = value[None]
        elif re.search(r"patching_and_embedding/vars/0$", name):
            out["patch_embedding/cls"] = value
        elif re.search(r"encoder/layer_norm/vars/([01])$", name):
            out["encoder_norm/" + ("gamma", "beta")[int(name[-1])]] = value
    order = sorted(blocks, key=lambda n: int(re.search(r"(?:_(\d+))?$", n).group(1) or 0))
    names = {"layer_norm_1": "layer_norm_0", "layer_norm_2": "layer_norm_1",
             "mha/query_dense": "attention/query", "mha/key_dense": "attention/key",
             "mha/value_dense": "attention/value", "mha/output_dense": "attention/out",
             "mlp/dense_1": "mlp/dense_0", "mlp/dense_2": "mlp/dense_1"}
    for i, block in enumerate(order):
        for (layer, index), value in blocks[block].items():
            leaf = (("gamma", "beta") if layer.startswith("layer_norm") else
                    ("kernel", "bias"))[int(index)]
            out[f"encoderblock_{i}/{names[layer]}/{leaf}"] = value
    if spec.num_classes:
        out.update(_keras_hub_head(datasets("task.weights.h5"), spec))
    return out


def _keras_hub_head(found, spec):
    dense = sorted((name, value) for name, value in found.items()
                   if re.match(r"layers/[^/]+/vars/[01]$", name))
    kernels = [(name.split("/")[1], value) for name, value in dense if name.endswith("/0")]
    biases = {name.split("/")[1]: value for name, value in dense if name.endswith("/1")}
    out = {}
    for layer, kernel in kernels:
        is_head = kernel.shape[-1] == spec.num_classes and (
            len(kernels) == 1 or kernel.shape[0] == spec.backbone.get("representation_size"))
        target = "head" if is_head and "head/kernel" not in out else "pre_logits"
        out[target + "/kernel"] = kernel
        out[target + "/bias"] = biases.get(layer)
    return out


def _pair_or_int(value):
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value[0] == value[-1] else tuple(int(v) for v in value)
    return int(value)


def _dense(path, weight, bias):
    """A PyTorch `Linear` `(out, in)` as a Keras `Dense` `(in, out)`."""
    return {path + "/kernel": np.transpose(weight), path + "/bias": bias}


def _attention_projection(path, weight, bias, heads):
    """A PyTorch `(N·K, D)` query/key/value projection as `(D, N, K)`, `(N, K)`."""
    out_dim, in_dim = weight.shape
    kernel = np.transpose(weight).reshape(in_dim, heads, out_dim // heads)
    return {path + "/kernel": kernel,
            path + "/bias": None if bias is None else np.reshape(bias, (heads, -1))}


def _attention_output(path, weight, bias, heads):
    """A PyTorch `(D, N·K)` output projection as `(N, K, D)`, `(D,)`."""
    out_dim, in_dim = weight.shape
    return {path + "/kernel": np.transpose(weight).reshape(heads, in_dim // heads, out_dim),
            path + "/bias": bias}


def read_spec(source, config, extra=None, where="the checkpoint"):
    """A checkpoint's `HubVitSpec` from its configs, before reading any weight.

    Args:
        source: `"timm"`, `"transformers"` or `"keras_hub"` (`detect_source`).
        config: the parsed `config.json`.
        extra: transformers' parsed `preprocessor_config.json`, KerasHub's
            `task.json`, or `None`.
        where: the checkpoint's name in error messages (handle or path).

    Raises:
        UnsupportedHubVitError: naming a feature the backbone cannot express.
    """
    if source == "timm":
        return _timm_spec(config, where)
    if source == "transformers":
        return _hf_spec(config, extra, where)
    if source == "keras_hub":
        return _keras_hub_spec(config, extra, where)
    raise ValueError(f"`source` must be one of {SOURCES}. Received: source={source!r}")


def read_weights(path, spec):
    """keras_vmoe weight path -> NumPy array, from a checkpoint directory.

    Absent biases are `None` (the model's own zeros); the source's input
    normalisation is folded into the patch embedding.

    Raises:
        UnsupportedHubVitError: the weights hold tensors the mapping does not use.
    """
    if spec.source == "keras_hub":
        weights = _keras_hub_weights(path, spec)
    else:
        tensors = dict(safetensors.load(os.path.join(path, SAFETENSORS_FILE)))
        mapper = _timm_weights if spec.source == "timm" else _hf_weights
        try:
            weights = mapper(tensors, spec)
        except KeyError as error:
            raise ValueError(
                f"{path}: the weights have no tensor {error.args[0]!r} that a "
                f"{spec.source} ViT of this config has; the file is not of this "
                "model.") from None
        if tensors:
            leftover = sorted(tensors)
            _refuse(path, f"weights the mapping does not use ({leftover[:6]}"
                    f"{' ...' if len(leftover) > 6 else ''}), e.g. layer scale or "
                    "registers")
    return fold_normalization(weights, spec.input_scale, spec.input_offset)


def fold_normalization(weights, scale, offset):
    """The patch embedding for inputs `v` when the source took `scale·v + offset`."""
    kernel = np.asarray(weights["patch_embedding/kernel"], "float64")  # (P, P, C, D)
    bias = weights.get("patch_embedding/bias")
    bias = np.zeros(kernel.shape[-1]) if bias is None else np.asarray(bias, "float64")
    scale = np.broadcast_to(np.asarray(scale, "float64"), kernel.shape[2])
    offset = np.broadcast_to(np.asarray(offset, "float64"), kernel.shape[2])
    dtype = np.asarray(weights["patch_embedding/kernel"]).dtype
    weights = dict(weights)
    weights["patch_embedding/kernel"] = (kernel * scale[:, None]).astype(dtype)
    weights["patch_embedding/bias"] = (
        bias + np.einsum("pqcd,c->d", kernel, offset)).astype(dtype)
    return weights
