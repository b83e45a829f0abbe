"""Per-device memory plan of a training step, from XLA's memory analysis.

One training step of a model with abstract weights is lowered on a virtual
mesh with the chosen layout and compiled with XLA's SPMD partitioner on CPU
devices; its `memory_analysis()` gives the measured numbers, the layout's
shard shapes the computed ones (see docs/guides/scaling-out.md).
"""

import json
import math
import os
import subprocess
import sys
import time

from keras_vmoe.catalog import PRESETS
from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.distribution import layouts
from keras_vmoe.distribution.launch import xla_flags_for_cpu_devices
from keras_vmoe.distribution.validation import check_divisible
from keras_vmoe.distribution.validation import tokens_per_image
from keras_vmoe.models.configs import abstract_weights
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.lora import enable_lora
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone
from keras_vmoe.presets.load import catalog_backbone_config
from keras_vmoe.utils.backend import MEMORY_PLAN_ALTERNATIVE
from keras_vmoe.utils.backend import require_jax
from keras_vmoe.utils.keras_internals import set_variable_layout
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_int

GIB = 1024**3


def _resolve(preset_or_config, num_classes):
    """`(backbone_config, num_classes, name)` of a preset name or a config."""
    if isinstance(preset_or_config, dict):
        return dict(preset_or_config), num_classes, "config"
    name = resolve_preset_name(preset_or_config)
    if name is None:
        raise ValueError(
            f"Unknown preset {preset_or_config!r}: pass a built-in preset name "
            "(see `keras-vmoe presets`) or a `VisionTransformerBackbone` config dict.")
    entry = PRESETS[name]
    config = catalog_backbone_config(entry)
    return config, num_classes or entry["task"]["num_classes"], name


def _mesh_shape(mesh_shape):
    shape = {"data": 1, "expert": 1, "model": 1}
    unknown = set(mesh_shape) - set(shape)
    if unknown:
        raise ValueError(
            f"Unknown mesh axes {sorted(unknown)} in mesh_shape={mesh_shape!r}; "
            "valid axes: data, expert, model.")
    for axis, size in mesh_shape.items():
        shape[axis] = check_int(size, f"mesh_shape[{axis!r}]")
    return shape


def _image_tokens(config):
    """Tokens one image gives an MoE layer (E³: with its member copies)."""
    return tokens_per_image(config) * config.get("ensemble_size", 1)


def _token_group_size(config):
    """Tokens per MoE routing group of a config (None: the whole batch)."""
    moe = config.get("moe") or {}
    if moe.get("images_per_group"):
        return moe["images_per_group"] * _image_tokens(config)
    return moe.get("group_size")


def memory_plan(preset_or_config, mesh_shape, batch_size, optimizer="adam",
                layout=None, num_classes=None, dtype=None, lora=None,
                images_per_group=None, remat=None, scan=None):
    """Per-device memory of one training step on a mesh, before launch.

    Args:
        preset_or_config: built-in preset name (e.g. `"vmoe_15b"`) or a
            `VisionTransformerBackbone` config dict.
        mesh_shape: `{"data": ..., "expert": ..., "model": ...}` (missing
            axes are 1).
        batch_size: global batch size (images).
        optimizer: Keras optimizer name or config (`"adam"`, `"sgd"`, ...).
        layout: one of `keras_vmoe.distribution.LAYOUTS`; default
            `"expert_model"` if `model > 1`, `"expert"` if `expert > 1`,
            else `"data"`.
        num_classes: head size (default: the preset's; none for a config).
        dtype: optional dtype policy of the model (e.g. `"mixed_bfloat16"`).
        lora: optional dict of `enable_lora` arguments (e.g. `{"rank": 8}`):
            plan a LoRA step, where only the factors and the head train.
        images_per_group: optional int, images per MoE routing group (replaces
            the preset's grouping).
        remat: optional bool, rematerialised encoder blocks (default: the
            preset's or config's setting).
        scan: optional bool, scanned encoder blocks (default: the preset's
            or config's setting).

    Returns:
        A dict: `bytes` (per device: `parameters`, `optimizer_slots`,
        `gradients`, `activations`, `xla_arguments`, `xla_temporaries`,
        `peak`), `measured`/`computed` (which keys came from XLA and which
        from the layout) and the settings used.

    Examples:
        >>> plan = memory_plan("vmoe_15b", {"expert": 8}, batch_size=16)  # doctest: +SKIP
        >>> plan["bytes"]["peak"] / 2**30  # GiB per device  # doctest: +SKIP
    """
    require_jax("keras_vmoe.training.memory_plan", MEMORY_PLAN_ALTERNATIVE)
    config, num_classes, name = _resolve(preset_or_config, num_classes)
    shape = _mesh_shape(mesh_shape)
    if layout is None:
        layout = ("expert_model" if shape["model"] > 1
                  else "expert" if shape["expert"] > 1 else "data")
    batch_size = check_int(batch_size, "batch_size")
    if dtype is not None:
        config["dtype"] = dtype
    if remat is not None:
        config["remat"] = check_bool(remat, "remat")
    if scan is not None:
        config["scan"] = check_bool(scan, "scan")
    if images_per_group is not None:
        images_per_group = check_int(images_per_group, "images_per_group")
        if not config.get("moe"):
            raise ValueError(f"`images_per_group` applies to MoE models; {name!r} has "
                             "no MoE layers.")
        config["moe"] = dict(config["moe"], images_per_group=images_per_group,
                             group_size=None)
    shards = shape["data"] * (1 if layout == "data" else shape["expert"])
    if config.get("moe") and config["moe"].get("group_size") is None and config[
            "moe"].get("images_per_group") is None and config.get("moe_layers"):
        # One token group per device (None would group the whole batch).
        per_device = max(batch_size // shards, 1)
        config["moe"] = dict(config["moe"],
                             group_size=per_device * _image_tokens(config))
    check_divisible(shape, layout, config=config, batch_size=batch_size)
    request = dict(config=config, num_classes=num_classes, mesh_shape=shape,
                   batch_size=batch_size, optimizer=optimizer, layout=layout)
    if lora:
        request["lora"] = dict(lora)
    import jax

    if len(jax.devices()) == math.prod(shape.values()) and jax.default_backend() == "cpu":
        result = _measure(**request)
    else:
        result = _measure_in_subprocess(request)
    result.update(preset=name, layout=layout, mesh_shape=shape, batch_size=batch_size,
                  remat=bool(config.get("remat", False)),
                  scan=bool(config.get("scan", False)),
                  optimizer=optimizer, group_size=_token_group_size(config))
    return result


def _measure_in_subprocess(request):
    env = dict(os.environ)
    devices = math.prod(request["mesh_shape"].values())
    env["XLA_FLAGS"] = xla_flags_for_cpu_devices(devices, env.get("XLA_FLAGS", ""))
    env.update(JAX_PLATFORMS="cpu", KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-m", "keras_vmoe.training.memory_plan"],
                          input=json.dumps(request, default=list), capture_output=True,
                          text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"The memory-plan compile failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shard_bytes(shape, dtype, sharding):
    import numpy as np

    local = sharding.shard_shape(tuple(shape))
    return math.prod(local) * np.dtype(dtype).itemsize


def _slice_config(config, num_layers):
    """`config` cut to `num_layers` blocks, keeping its MoE pattern (period 2)."""
    moe_layers = tuple(i for i in config.get("moe_layers", ()) if i < num_layers)
    return dict(config, num_layers=num_layers, moe_layers=moe_layers)


def _periodic(config, period=2):
    layers = set(config.get("moe_layers", ()))
    return all((i in layers) == ((i % period) in layers) for i in range(config["num_layers"]))


def _measure(config, num_classes, mesh_shape, batch_size, optimizer, layout,
             slice_layers=(2, 4), lora=None):
    """Compiles the full step, or for deep periodic models 2- and 4-block
    slices whose XLA numbers are extrapolated linearly in the depth."""
    full = _measure_one(config, num_classes, mesh_shape, batch_size, optimizer, layout,
                        lora=lora)
    depth = config.get("num_layers", 12)
    if not full.pop("compiled"):
        small, large = (
            _measure_one(_slice_config(config, n), num_classes, mesh_shape, batch_size,
                         optimizer, layout, compile_step=True, lora=lora)
            for n in slice_layers)
        scale = (depth - slice_layers[0]) / (slice_layers[1] - slice_layers[0])
        for key in ("xla_arguments", "xla_temporaries", "peak"):
            a, b = small["bytes"][key], large["bytes"][key]
            full["bytes"][key] = int(round(a + (b - a) * scale))
        full["bytes"]["activations"] = full["bytes"]["xla_temporaries"]
        full["measured_on"] = (
            f"XLA compiles of {slice_layers[0]}- and {slice_layers[1]}-block slices, "
            f"extrapolated linearly to {depth} blocks")
    else:
        full["measured_on"] = f"XLA compile of the full {depth}-block model"
    return full


def _measure_one(config, num_classes, mesh_shape, batch_size, optimizer, layout,
                 compile_step=None, lora=None):
    import jax
    import keras

    config = dict(config)
    if isinstance(config.get("moe_layers"), list):  # from JSON
        config["moe_layers"] = tuple(config["moe_layers"])
    mesh = layouts.make_mesh(devices=keras.distribution.list_devices(), **mesh_shape)
    dist = layouts.make_distribution(layout, mesh)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(dist)
    try:
        opt = keras.optimizers.get(optimizer)  # two scalars, allocated
        with abstract_weights():
            backbone = VisionTransformerBackbone(**config)
            model = (ImageClassifier(backbone, num_classes=num_classes, compile=False)
                     if num_classes else backbone)
            if lora:  # only the LoRA factors (and the head) train
                enable_lora(model, **lora)
            for variable in model.weights:
                # What Keras does when it initializes a variable; abstract
                # variables skip it, and optimizer slots copy this layout.
                set_variable_layout(variable, dist.get_variable_layout(variable))
            opt.build(model.trainable_variables)
        if compile_step is None:
            compile_step = config.get("num_layers", 12) <= 4 or not _periodic(config)
        return _compile_step(model, opt, dist, config, batch_size, num_classes, jax, keras,
                             compile_step)
    finally:
        keras.distribution.set_distribution(previous)


def _compile_step(model, opt, dist, config, batch_size, num_classes, jax, keras,
                  compile_step=True):
    def sharding(variable):
        return dist.get_variable_layout(variable).backend_layout

    def abstract(variables):
        return [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=sharding(v))
                for v in variables]

    trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
    opt_vars = opt.variables
    image = config.get("image_size", 224)
    image = (image, image) if isinstance(image, int) else tuple(image)
    x_shape = (batch_size, *image, config.get("num_channels", 3))
    x = jax.ShapeDtypeStruct(x_shape, "float32",
                             sharding=dist.get_data_layout(x_shape).backend_layout)
    y = jax.ShapeDtypeStruct((batch_size,), "int32",
                             sharding=dist.get_data_layout((batch_size,)).backend_layout)

    def step(trainable_values, non_trainable_values, opt_values, x, y):
        def loss_fn(values):
            out, new_nt, losses = model.stateless_call(
                values, non_trainable_values, x, training=True, return_losses=True)
            out = keras.ops.cast(out, "float32")
            if num_classes:
                loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
                    y, out, from_logits=True))
            else:
                loss = keras.ops.mean(keras.ops.square(out))
            for extra in losses:
                loss = loss + keras.ops.cast(extra, "float32")
            return loss, new_nt

        (loss, new_nt), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable_values)
        new_trainable, new_opt = opt.stateless_apply(opt_values, grads, trainable_values)
        return loss, new_trainable, new_nt, new_opt

    args = (abstract(trainable), abstract(non_trainable), abstract(opt_vars), x, y)

    def total(arrays):
        return int(sum(_shard_bytes(a.shape, a.dtype, a.sharding) for a in arrays))

    result = {
        "bytes": {"parameters": total(args[0] + args[1]),
                  "optimizer_slots": total(args[2]), "gradients": total(args[0])},
        "measured": ["xla_arguments", "xla_temporaries", "peak"],
        "computed": ["parameters", "optimizer_slots", "gradients"],
        "derived": ["activations (= xla_temporaries: saved activations, workspace "
                    "and the gradients XLA does not fuse into the update)"],
        "num_parameters": int(sum(math.prod(v.shape) for v in model.weights)),
        "devices": len(jax.devices()),
        "compiled": compile_step,
    }
    if not compile_step:
        return result
    out_shardings = (None, [a.sharding for a in args[0]], [a.sharding for a in args[1]],
                     [a.sharding for a in args[2]])
    started = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1, 2), out_shardings=out_shardings).lower(
        *args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    result["seconds"] = {"lower": round(lowered_at - started, 3),
                         "compile": round(time.perf_counter() - lowered_at, 3)}
    stats = compiled.memory_analysis()
    temp = int(stats.temp_size_in_bytes)
    peak = int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + temp)
    arguments = int(stats.argument_size_in_bytes)
    result["bytes"].update(activations=temp, xla_arguments=arguments,
                           xla_temporaries=temp, peak=peak)
    return result


def format_plan(plan, device_memory_gib=None):
    """A Markdown table of a `memory_plan` result (GiB per device)."""
    rows = [
        ("parameters", "computed from the layout"),
        ("optimizer_slots", "computed from the layout"),
        ("gradients", "computed (XLA fuses most into the in-place update)"),
        ("activations", "measured: XLA temporaries (activations, workspace, unfused gradients)"),
        ("xla_arguments", "measured by XLA"),
        ("xla_temporaries", "measured by XLA"),
        ("peak", "measured by XLA: arguments + outputs - donated + temporaries"),
    ]
    measured_on = plan.get("measured_on", "XLA")
    shape = plan["mesh_shape"]
    lines = [
        f"{plan['preset']}: {plan['num_parameters']:,} parameters"
        f"{', rematerialised blocks' if plan.get('remat') else ''}"
        f"{', scanned blocks' if plan.get('scan') else ''}, layout "
        f"{plan['layout']!r}, mesh data={shape['data']} expert={shape['expert']} "
        f"model={shape['model']} ({plan['devices']} devices), global batch "
        f"{plan['batch_size']}, optimizer {plan['optimizer']}, MoE group_size "
        f"{plan['group_size']}. Measured: {measured_on}.",
        "",
        "| per device | GiB | source |",
        "|---|---:|---|",
    ]
    for key, source in rows:
        lines.append(f"| {key.replace('_', ' ')} | {plan['bytes'][key] / GIB:.2f} | {source} |")
    if device_memory_gib:
        fits = plan["bytes"]["peak"] <= device_memory_gib * GIB
        lines += ["", f"{'Fits' if fits else 'Does NOT fit'} in "
                      f"{device_memory_gib:g} GiB per device."]
        with_remat = plan.get("with_remat")
        if with_remat:
            peak = with_remat["peak"] / GIB
            lines.append(
                f"With --remat (rematerialised encoder blocks) the peak is {peak:.2f} GiB: "
                + ("it fits; train with `remat=True` (`keras-vmoe finetune --remat`)."
                   if with_remat["fits"] else "it still does not fit; use more devices "
                   "or a smaller batch."))
    return "\n".join(lines)


if __name__ == "__main__":
    _request = json.loads(sys.stdin.read())
    print(json.dumps(_measure(**_request)))
