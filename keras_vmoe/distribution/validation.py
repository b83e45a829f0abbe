"""Up-front divisibility checks of a layout against a model config."""

from keras_vmoe.utils.validation import patch_grid


def mesh_sizes(mesh):
    """`{axis_name: size}` of a `DeviceMesh`."""
    return dict(zip(mesh.axis_names, mesh.shape, strict=True))


def tokens_per_image(config):
    """Tokens T per image of a `VisionTransformerBackbone` config."""
    grid = patch_grid(config.get("image_size", 224), config.get("patch_size", 16))
    tokens = grid[0] * grid[1]
    return tokens + int(config.get("classifier", "token") == "token")


def check_divisible(sizes, layout, config=None, batch_size=None):
    """Raises one `ValueError` listing every dimension a layout cannot split.

    Args:
        sizes: `{axis: size}` of the mesh (`data`, `expert`, `model`).
        layout: one of `layouts.LAYOUTS`.
        config: optional `VisionTransformerBackbone` config dict.
        batch_size: optional global batch size.
    """
    data, expert, model = (sizes.get(a, 1) for a in ("data", "expert", "model"))
    batch_shards = data if layout == "data" else data * expert
    batch_axes = "'data'" if layout == "data" else "'data' x 'expert'"
    problems = []
    if batch_size is not None and batch_size % batch_shards:
        problems.append(
            f"batch_size={batch_size} is not divisible by the {batch_axes} mesh "
            f"axes ({batch_shards} devices); use a multiple of {batch_shards}.")
    moe = (config or {}).get("moe") or None
    if config is not None and moe and config.get("moe_layers"):
        num_experts = moe.get("num_experts")
        if layout != "data" and num_experts and num_experts % expert:
            problems.append(
                f"num_experts={num_experts} is not divisible by the 'expert' mesh "
                f"axis of size {expert}; use an expert axis that divides it.")
        if batch_size is not None and moe.get("type", "sparse") == "sparse":
            tokens = batch_size * config.get("ensemble_size", 1) * tokens_per_image(config)
            group = moe.get("group_size") or tokens
            if moe.get("images_per_group"):
                group = (moe["images_per_group"] * config.get("ensemble_size", 1)
                         * tokens_per_image(config))
            groups = tokens // group
            if tokens % group == 0 and groups % batch_shards:
                problems.append(
                    f"The batch of {batch_size} images makes {groups} token group(s) "
                    f"of {group} tokens, which the {batch_axes} "
                    f"mesh axes ({batch_shards} devices) cannot split; set the MoE "
                    "group_size so that the number of groups is a multiple of "
                    f"{batch_shards} (e.g. images_per_group dividing "
                    f"{batch_size // batch_shards if batch_size >= batch_shards else 1}; "
                    "`keras-vmoe plan`: --images-per-group).")
    if config is not None and layout in ("expert_model", "pod"):
        for name in ("num_heads", "mlp_dim"):
            value = config.get(name)
            if value and value % model:
                problems.append(f"{name}={value} is not divisible by the 'model' "
                                f"mesh axis of size {model}.")
    if config is not None and layout == "pod":
        hidden = config.get("hidden_dim")
        if hidden and hidden % data:
            problems.append(
                f"hidden_dim={hidden} is not divisible by the 'data' mesh axis of size "
                f"{data} (the pod layout splits weights over it).")
    if problems:
        raise ValueError(
            f"The {layout!r} layout cannot split this model over the mesh "
            f"{dict(sizes)}:\n- " + "\n- ".join(problems)
        )
