"""Infers a `VisionTransformerBackbone` architecture from upstream parameter shapes.

`canonicalize` maps vmoe and vit_jax (pre-Linen or Linen) paths to the vmoe
naming; `infer_architecture` reads the structure from a `{path: shape}`
dict; routing, which the tree does not record, is a `RoutingSettings`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from keras_vmoe.utils.validation import check_group
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of
from keras_vmoe.utils.validation import check_pair
from keras_vmoe.utils.validation import patch_grid

__all__ = [
    "ROUTER_NAMES",
    "ConversionError",
    "RoutingSettings",
    "UpstreamArchitecture",
    "upstream_backbone_config",
    "canonicalize",
    "infer_architecture",
    "resolve_routing",
]

# Leading keys some checkpoints wrap the parameter tree in.
_WRAPPER_PREFIXES = ("opt/target/", "params/", "target/")

_BLOCK = re.compile(r"^Encoder/encoderblock_(\d+)/(.*)$")
_ANY_BLOCK = re.compile(r"^(?:Encoder|Transformer)/encoderblock_(\d+)/(.*)$")

ROUTER_NAMES = ("token_choice", "expert_choice")


class ConversionError(ValueError):
    """An upstream checkpoint cannot be converted (unknown or inconsistent)."""


def _block_scheme(block_paths):
    """"prelinen", "linen" or "vmoe" naming of one encoder block's sub-paths."""
    heads = {p.split("/", 1)[0] for p in block_paths}
    if heads & {"MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"}:
        return "prelinen"
    if heads & {"MultiHeadDotProductAttention_0", "MlpBlock_0"}:
        return "linen"
    return "vmoe"


_BLOCK_RENAMES = {
    "prelinen": {
        "MultiHeadDotProductAttention_1": "SelfAttention",
        "LayerNorm_2": "LayerNorm_1",
        "MlpBlock_3": "Mlp",
    },
    "linen": {"MultiHeadDotProductAttention_0": "SelfAttention", "MlpBlock_0": "Mlp"},
}
_MAP_HEAD_RENAMES = {
    # big_vision style MAP heads.
    "MAPHead_0": "MapHead",
    "MapHead/MultiHeadDotProductAttention_0": "MapHead/MultiHeadDotProductAttention",
    "MapHead/LayerNorm_0": "MapHead/LayerNorm",
    "MapHead/MlpBlock_0": "MapHead/Mlp",
}


def canonicalize(paths) -> dict[str, str]:
    """`{canonical_path: original_path}` of "/"-joined upstream paths (vmoe or
    vit_jax naming, maybe wrapped in `opt/target/` or `params/`).

    Raises:
        ConversionError: if two paths map to the same canonical path.
    """
    paths = list(paths)
    wrapper = next((prefix for prefix in _WRAPPER_PREFIXES
                    if paths and all(p.startswith(prefix) for p in paths)), "")
    stripped = {p: p[len(wrapper):] for p in paths}
    blocks: dict[str, list[str]] = {}
    for path in stripped.values():
        match = _ANY_BLOCK.match(path)
        if match:
            blocks.setdefault(match.group(1), []).append(match.group(2))
    schemes = {index: _block_scheme(subpaths) for index, subpaths in blocks.items()}

    result: dict[str, str] = {}
    for original, path in stripped.items():
        canonical = path
        if canonical.startswith("Transformer/"):
            canonical = "Encoder/" + canonical[len("Transformer/"):]
        match = _BLOCK.match(canonical)
        if match:
            index, rest = match.groups()
            renames = _BLOCK_RENAMES.get(schemes[index], {})
            head, _, tail = rest.partition("/")
            if head in renames:
                rest = renames[head] + ("/" + tail if tail else "")
            canonical = f"Encoder/encoderblock_{index}/{rest}"
        for old, new in _MAP_HEAD_RENAMES.items():
            if canonical == old or canonical.startswith(old + "/"):
                canonical = new + canonical[len(old):]
        if canonical in result:
            raise ConversionError(
                f"Upstream paths {result[canonical]!r} and {original!r} both map to "
                f"{canonical!r}; the checkpoint mixes naming schemes."
            )
        result[canonical] = original
    return result


@dataclasses.dataclass(frozen=True)
class UpstreamArchitecture:
    """Structure of an upstream model, read from its parameter shapes.

    Attributes:
        mlp_dim: M of the dense blocks (the expert size if every block is MoE).
        checkpoint_grid: patch grid of the stored learned position embedding
            (None without one); differs from `grid` when it is resized.
        moe_kind: None (dense), "sparse", "partitioned" (E³) or "soft".
        ensemble_size: N of E³ (1 otherwise).
        router_kernel_shape: stored router kernel shape (sparse/E³).
        naming: "vmoe" or "vit_jax".
    """

    image_size: tuple[int, int]
    patch_size: tuple[int, int]
    num_channels: int
    hidden_dim: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    classifier: str
    position_embedding: str
    checkpoint_grid: tuple[int, int] | None
    qk_norm: bool
    representation_size: int | None
    num_classes: int | None
    moe_layers: tuple[int, ...]
    moe_kind: str | None
    num_experts: int | None
    expert_mlp_dim: int | None
    ensemble_size: int
    num_slots: int | None
    router_kernel_shape: tuple[int, ...] | None
    naming: str

    @property
    def grid(self) -> tuple[int, int]:
        return patch_grid(self.image_size, self.patch_size)

    @property
    def tokens_per_image(self) -> int:
        return math.prod(self.grid) + int(self.classifier == "token")

    def summary(self) -> str:
        """One line describing the model."""
        parts = [
            f"D={self.hidden_dim}", f"L={self.num_layers}", f"H={self.num_heads}",
            f"M={self.mlp_dim}", f"P={self.patch_size[0]}",
            f"{self.image_size[0]}px", f"classifier={self.classifier}",
        ]
        if self.moe_kind:
            parts.append(f"{self.moe_kind} MoE E={self.num_experts} in blocks "
                         f"{list(self.moe_layers)}")
        if self.ensemble_size > 1:
            parts.append(f"ensemble N={self.ensemble_size}")
        if self.num_slots:
            parts.append(f"slots={self.num_slots}")
        if self.representation_size:
            parts.append(f"pre_logits={self.representation_size}")
        if self.num_classes:
            parts.append(f"classes={self.num_classes}")
        return ", ".join(parts)


def _shape(shapes, path):
    return tuple(int(d) for d in shapes[path])


def _require(shapes, path, ndim, what):
    if path not in shapes:
        raise ConversionError(
            f"The checkpoint has no {path!r} ({what}); it is not a ViT / V-MoE "
            f"parameter tree. First paths: {sorted(shapes)[:8]}"
        )
    shape = _shape(shapes, path)
    if len(shape) != ndim:
        raise ConversionError(
            f"{path!r} ({what}) should have {ndim} dimensions but has shape {shape}."
        )
    return shape


def _checked(check, *args, **kwargs):
    """`check(*args, **kwargs)`, its `ValueError` as a `ConversionError`."""
    try:
        return check(*args, **kwargs)
    except ValueError as error:
        raise ConversionError(str(error)) from None


def _block_path(i, rest):
    return f"Encoder/encoderblock_{i}/{rest}"


def _read_blocks(canon, shapes):
    """`({index: {sub-path, ...}}, num_layers)` of the encoder blocks."""
    block_keys: dict[int, set[str]] = {}
    for path in canon:
        match = _BLOCK.match(path)
        if match:
            block_keys.setdefault(int(match.group(1)), set()).add(match.group(2))
    if not block_keys:
        raise ConversionError(
            "The checkpoint has no encoder blocks (Encoder/encoderblock_i or "
            f"Transformer/encoderblock_i). First paths: {sorted(shapes)[:8]}"
        )
    num_layers = max(block_keys) + 1
    missing = sorted(set(range(num_layers)) - set(block_keys))
    if missing:
        raise ConversionError(f"Encoder blocks {missing} are missing from the checkpoint.")
    return block_keys, num_layers


def _read_attention(canon, hidden):
    """`(num_heads, qk_norm)` of the first block's attention."""
    query = _require(canon, _block_path(0, "SelfAttention/query/kernel"), 3,
                     "the attention query kernel")
    if query[0] != hidden:
        raise ConversionError(
            f"Attention width {query[0]} differs from the patch embedding width {hidden}."
        )
    num_heads = query[1]
    if query[1] * query[2] != hidden:
        raise ConversionError(
            f"Attention query kernel {query} does not split D={hidden} into heads."
        )
    qk_norm = _block_path(0, "SelfAttention/query_ln/scale") in canon
    return num_heads, qk_norm


def _read_dense_mlp_dim(canon, dense_layers):
    """The MLP size M shared by the dense blocks (None without any)."""
    mlp_dim = None
    for i in dense_layers:
        dense = _require(canon, _block_path(i, "Mlp/Dense_0/kernel"), 2,
                         "a dense MLP kernel")
        if mlp_dim is not None and dense[1] != mlp_dim:
            raise ConversionError(
                f"Dense blocks have different MLP sizes ({mlp_dim} and {dense[1]})."
            )
        mlp_dim = dense[1]
    return mlp_dim


def _read_router(canon, i, experts, block_keys):
    """`(kind, members, slots, router_kernel_shape)` of MoE block `i`, whose
    stacked expert kernels have shape `experts` `(E, D, M)`."""
    dense_router = _block_path(i, "Moe/Router/dense/kernel")
    soft_router = _block_path(i, "Moe/Router/mu")
    if dense_router in canon:
        router = _shape(canon, dense_router)
        if len(router) == 2:
            return "sparse", 1, None, router
        if len(router) != 3:
            raise ConversionError(
                f"Router kernel {dense_router!r} has unsupported shape {router}."
            )
        if router[1] * router[2] != experts[0]:
            raise ConversionError(
                f"E³ router kernel {dense_router!r} has shape {router}, which "
                f"does not split E={experts[0]} experts into members."
            )
        return "partitioned", router[1], None, router
    if soft_router in canon:
        mu = _shape(canon, soft_router)
        if len(mu) != 3 or mu[1] != experts[0]:
            raise ConversionError(
                f"Soft MoE {soft_router!r} has shape {mu}; expected "
                f"(D, E={experts[0]}, slots)."
            )
        return "soft", 1, mu[2], None
    raise ConversionError(
        f"MoE block {i} has no router (neither Moe/Router/dense/kernel nor "
        f"Moe/Router/mu). Its parameters: {sorted(block_keys[i])}"
    )


def _read_moe(canon, moe_layers, block_keys):
    """`(moe_kind, num_experts, expert_mlp_dim, members, num_slots,
    router_kernel_shape)` of the MoE layers, which must all agree."""
    moe_kind = None
    num_experts = expert_mlp_dim = num_slots = router_shape = None
    members = 1
    for i in moe_layers:
        experts = _require(canon, _block_path(i, "Moe/Mlp/Dense_0/kernel"), 3,
                           "the stacked expert kernels (E, D, M)")
        kind, layer_members, layer_slots, router = _read_router(
            canon, i, experts, block_keys)
        current = (kind, experts[0], experts[2], layer_members, layer_slots)
        if moe_kind is None:
            moe_kind, num_experts, expert_mlp_dim, members, num_slots = current
            router_shape = router
        elif current != (moe_kind, num_experts, expert_mlp_dim, members, num_slots):
            raise ConversionError(
                "All MoE blocks must have the same router kind, number of experts, "
                f"expert size, members and slots; block {moe_layers[0]} has "
                f"{(moe_kind, num_experts, expert_mlp_dim, members, num_slots)} and "
                f"block {i} has {current}."
            )
    return moe_kind, num_experts, expert_mlp_dim, members, num_slots, router_shape


def _apply_ensemble_size(ensemble_size, moe_kind, num_experts, members, router_shape):
    """`(moe_kind, members)`: a sparse model with `ensemble_size` > 1 becomes E³."""
    if ensemble_size is not None and ensemble_size > 1:
        if moe_kind == "sparse":
            if num_experts % ensemble_size:
                raise ConversionError(
                    f"ensemble_size={ensemble_size} does not divide E={num_experts}."
                )
            moe_kind, members = "partitioned", ensemble_size
        elif moe_kind == "partitioned" and members != ensemble_size:
            raise ConversionError(
                f"The E³ router kernels {router_shape} have {members} members, but "
                f"ensemble_size={ensemble_size} was requested."
            )
        elif moe_kind not in ("sparse", "partitioned"):
            raise ConversionError(
                f"ensemble_size={ensemble_size} needs sparse MoE layers; the "
                f"checkpoint has {moe_kind or 'none'}."
            )
    return moe_kind, members


def _read_classifier(canon):
    """"token" (class token), "map" (MAP head) or "gap"."""
    if "cls" in canon:
        return "token"
    if any(p.startswith("MapHead/") for p in canon):
        return "map"
    return "gap"


def _learned_grid(pos, classifier, patch_size, image_size):
    """The `(h, w)` patch grid of a learned position embedding of shape `pos`."""
    grid_tokens = pos[1] - int(classifier == "token")
    side = math.isqrt(max(grid_tokens, 0))
    if side * side == grid_tokens and side != 0:
        return (side, side)
    if image_size is None:
        raise ConversionError(
            f"The position embedding has {grid_tokens} grid tokens, not a "
            "square grid; pass image_size=(height, width)."
        )
    image_hw = check_pair(image_size, "image_size")
    checkpoint_grid = patch_grid(image_hw, patch_size)
    if checkpoint_grid[0] * checkpoint_grid[1] != grid_tokens:
        raise ConversionError(
            f"image_size={image_hw} with patch {patch_size} gives "
            f"{checkpoint_grid[0] * checkpoint_grid[1]} tokens, but the "
            f"position embedding has {grid_tokens}."
        )
    return checkpoint_grid


def _read_position_embedding(canon, classifier, patch_size, image_size,
                             position_embedding):
    """`(position_embedding, checkpoint_grid, image_hw)`."""
    pos_path = "Encoder/posembed_input/pos_embedding"
    checkpoint_grid = None
    if pos_path in canon:
        pos = _require(canon, pos_path, 3, "the position embedding")
        if position_embedding not in (None, "learned"):
            raise ConversionError(
                f"The checkpoint has a learned position embedding; "
                f"position_embedding={position_embedding!r} cannot be used."
            )
        position_embedding = "learned"
        checkpoint_grid = _learned_grid(pos, classifier, patch_size, image_size)
        default_size = (checkpoint_grid[0] * patch_size[0], checkpoint_grid[1] * patch_size[1])
    else:
        if position_embedding is None:
            position_embedding = "sincos2d"
        if position_embedding not in ("sincos2d", "none"):
            raise ConversionError(
                "The checkpoint has no learned position embedding; "
                f"position_embedding must be 'sincos2d' or 'none'. Received: "
                f"{position_embedding!r}"
            )
        default_size = (224, 224)
    image_hw = check_pair(image_size, "image_size") if image_size is not None else default_size
    if image_hw[0] % patch_size[0] or image_hw[1] % patch_size[1]:
        raise ConversionError(
            f"image_size={image_hw} is not a multiple of the patch size {patch_size}."
        )
    return position_embedding, checkpoint_grid, image_hw


def _read_heads(canon, hidden):
    """`(representation_size, num_classes)`, each None when absent."""
    representation_size = None
    if "pre_logits/kernel" in canon:
        pre = _require(canon, "pre_logits/kernel", 2, "the pre-logits kernel")
        representation_size = pre[1]
    num_classes = None
    if "head/kernel" in canon:
        head = _require(canon, "head/kernel", 2, "the head kernel")
        num_classes = head[1]
        expected_in = representation_size or hidden
        if head[0] != expected_in:
            raise ConversionError(
                f"head/kernel has shape {head}; its input should be {expected_in}."
            )
    return representation_size, num_classes


def infer_architecture(
    shapes: Mapping[str, Any],
    image_size: int | tuple[int, int] | None = None,
    position_embedding: str | None = None,
    ensemble_size: int | None = None,
) -> UpstreamArchitecture:
    """Reads the model structure from upstream parameter shapes.

    Args:
        shapes: `{upstream_path: shape}` (any naming `canonicalize` accepts;
            values may also be arrays, only their `.shape` is used).
        image_size: resolution to run at. Default: that of the learned
            position embedding (square grid), 224 without one; another size
            resizes the position embedding when the weights are converted.
        position_embedding: "sincos2d" (default) or "none" for checkpoints
            without a learned position embedding; "learned" or None with one.
        ensemble_size: E³ members for a checkpoint storing the E³ router
            kernel 2-D `(D, E)`; a 3-D `(D, N, E/N)` kernel gives N itself.

    Returns:
        An `UpstreamArchitecture`.

    Raises:
        ConversionError: for unsupported or inconsistent trees.
    """
    shapes = {k: tuple(getattr(v, "shape", v)) for k, v in shapes.items()}
    mapping = canonicalize(shapes)
    naming = "vit_jax" if any("/Transformer/" in "/" + p for p in shapes) else "vmoe"
    canon = {c: shapes[o] for c, o in mapping.items()}

    kernel = _require(canon, "embedding/kernel", 4, "the patch embedding kernel")
    patch_size = (kernel[0], kernel[1])
    num_channels, hidden = kernel[2], kernel[3]
    block_keys, num_layers = _read_blocks(canon, shapes)
    num_heads, qk_norm = _read_attention(canon, hidden)
    moe_layers = tuple(
        i for i in range(num_layers) if any(k.startswith("Moe/") for k in block_keys[i])
    )
    dense_layers = [i for i in range(num_layers) if i not in moe_layers]
    mlp_dim = _read_dense_mlp_dim(canon, dense_layers)
    moe_kind, num_experts, expert_mlp_dim, members, num_slots, router_shape = _read_moe(
        canon, moe_layers, block_keys)
    moe_kind, members = _apply_ensemble_size(
        ensemble_size, moe_kind, num_experts, members, router_shape)
    if mlp_dim is None:
        mlp_dim = expert_mlp_dim
    classifier = _read_classifier(canon)
    position_embedding, checkpoint_grid, image_hw = _read_position_embedding(
        canon, classifier, patch_size, image_size, position_embedding)
    representation_size, num_classes = _read_heads(canon, hidden)

    return UpstreamArchitecture(
        image_size=image_hw,
        patch_size=patch_size,
        num_channels=num_channels,
        hidden_dim=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        mlp_dim=mlp_dim,
        classifier=classifier,
        position_embedding=position_embedding,
        checkpoint_grid=checkpoint_grid,
        qk_norm=qk_norm,
        representation_size=representation_size,
        num_classes=num_classes,
        moe_layers=moe_layers,
        moe_kind=moe_kind,
        num_experts=num_experts,
        expert_mlp_dim=expert_mlp_dim,
        ensemble_size=members,
        num_slots=num_slots,
        router_kernel_shape=router_shape,
        naming=naming,
    )


@dataclasses.dataclass(frozen=True)
class RoutingSettings:
    """Routing of the MoE layers, which the parameter tree does not record.

    `None` means the default for the model kind (`resolve_routing`).

    Attributes:
        router: "token_choice" or "expert_choice" (sparse layers only).
        group_size: tokens routed together (E³: counting the N copies), or
            "all"; exclusive with `images_per_group` (default 8, 128 for E³).
        bfloat16_dispatch: round expert inputs/outputs to bfloat16 as
            upstream's `dispatcher.bfloat16`.
        dispatch: "index" (gather/scatter, fast) or "einsum".
        eval_routing: dict of the settings that differ in evaluation, e.g.
            `{"capacity_factor": 4.0}` (the backbone's `moe["eval_routing"]`).
    """

    router: str | None = None
    num_selected_experts: int | None = None
    capacity_factor: float | None = None
    capacity_ceil_or_round: str | None = None
    capacity_multiple_of: int | None = None
    group_size: int | str | None = None
    images_per_group: int | None = None
    batch_priority: bool | None = None
    bfloat16_dispatch: bool | None = None
    dispatch: str | None = None
    eval_routing: dict | None = None

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def merged(self, **overrides) -> RoutingSettings:
        """A copy with the non-None `overrides` applied."""
        unknown = sorted(set(overrides) - set(self.fields()))
        if unknown:
            raise TypeError(
                f"Unknown routing settings {unknown}. Valid: {list(self.fields())}."
            )
        values = {k: v for k, v in overrides.items() if v is not None}
        if "group_size" in values and "images_per_group" not in values:
            values["images_per_group"] = None
        if "images_per_group" in values and "group_size" not in values:
            values["group_size"] = None
        return dataclasses.replace(self, **values)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


# The V-MoE paper's (K=2, cf 1.05) and E³ paper's (K=1, cf 1.5) settings.
_DEFAULTS = {
    "sparse": dict(router="token_choice", num_selected_experts=2, capacity_factor=1.05),
    "partitioned": dict(router="token_choice", num_selected_experts=1,
                        capacity_factor=1.5),
}
# Upstream's images per routing group (keras_vmoe.models.configs).
_IMAGES_PER_GROUP = {"sparse": 8, "partitioned": 128}


def resolve_routing(arch: UpstreamArchitecture,
                    routing: RoutingSettings | Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Fills in the defaults and checks routing settings against a model.

    Returns:
        Every applicable setting for the model's MoE kind (empty if dense).

    Raises:
        ConversionError: for settings that do not fit the model.
    """
    if routing is None:
        routing = RoutingSettings()
    elif isinstance(routing, Mapping):
        routing = RoutingSettings().merged(**routing)
    given = routing.as_dict()
    if arch.moe_kind is None:
        return {}
    if arch.moe_kind == "soft":
        if given.get("group_size") == "all":
            given.pop("group_size")
        ignored = sorted(set(given) - {"bfloat16_dispatch", "dispatch"})
        if ignored:
            raise ConversionError(
                f"Soft MoE checkpoints have a fixed routing (one group per image); "
                f"the settings {ignored} do not apply."
            )
        # False is allowed: an exact-f32 variant of upstream's bf16 Soft MoE.
        return {"bfloat16_dispatch": given.get("bfloat16_dispatch", True)}

    settings = dict(_DEFAULTS[arch.moe_kind])
    settings.update(bfloat16_dispatch=True, batch_priority=False,
                    capacity_ceil_or_round="ceil", capacity_multiple_of=4)
    settings.update(given)
    router = _checked(check_one_of, settings["router"], "router", ROUTER_NAMES)
    if arch.moe_kind == "partitioned" and router != "token_choice":
        raise ConversionError(
            "E³ (partitioned) checkpoints route with Token Choice only. "
            f"Received: router={router!r}"
        )
    if router == "expert_choice":
        bad = sorted(k for k in ("num_selected_experts", "batch_priority") if k in given)
        if bad:
            raise ConversionError(
                f"Expert Choice routing has no {bad} setting(s). Received: "
                + ", ".join(f"{k}={given[k]!r}" for k in bad)
            )
        settings.pop("num_selected_experts", None)
        settings.pop("batch_priority", None)
    else:
        limit = arch.num_experts // arch.ensemble_size
        settings["num_selected_experts"] = _checked(
            check_int, settings["num_selected_experts"], "num_selected_experts",
            maximum=limit,
        )
    _check_capacity_factor(settings["capacity_factor"], "capacity_factor")
    _checked(check_one_of, settings["capacity_ceil_or_round"], "capacity_ceil_or_round",
             ("ceil", "round"))
    group_size = settings.pop("group_size", None)
    images = settings.pop("images_per_group", None)
    if group_size is None and images is None:
        images = _IMAGES_PER_GROUP[arch.moe_kind]
    images = _checked(check_int, images, "images_per_group", allow_none=True)
    # An upstream config may give both: `group_size` wins.
    group_size, _ = _checked(
        check_group, group_size=group_size, ensemble_size=arch.ensemble_size
    )
    settings["group_size"] = group_size
    settings["images_per_group"] = images if group_size is None else None
    eval_routing = settings.pop("eval_routing", None)
    if eval_routing:
        cf = eval_routing.get("capacity_factor")
        if cf is not None:
            _check_capacity_factor(cf, "eval_routing capacity_factor")
        settings["eval_routing"] = dict(eval_routing)
    return settings


def _check_capacity_factor(cf, name):
    if isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0:
        raise ConversionError(f"{name} must be > 0. Received: {cf!r}")


def upstream_backbone_config(arch: UpstreamArchitecture,
                    routing: RoutingSettings | Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """`VisionTransformerBackbone` keyword arguments for `arch` (from
    `infer_architecture`), `routing` completed by `resolve_routing`."""
    settings = resolve_routing(arch, routing)
    image, patch = arch.image_size, arch.patch_size
    config: dict[str, Any] = dict(
        image_size=image[0] if image[0] == image[1] else list(image),
        patch_size=patch[0] if patch[0] == patch[1] else list(patch),
        hidden_dim=arch.hidden_dim,
        num_layers=arch.num_layers,
        num_heads=arch.num_heads,
        mlp_dim=arch.mlp_dim,
        classifier=arch.classifier,
        position_embedding=arch.position_embedding,
        moe_layers=list(arch.moe_layers),
        moe=None,
        qk_norm=arch.qk_norm,
        representation_size=arch.representation_size,
        num_channels=arch.num_channels,
    )
    if arch.ensemble_size > 1:
        config["ensemble_size"] = arch.ensemble_size
    if arch.moe_kind is None:
        return config
    moe: dict[str, Any] = {"num_experts": arch.num_experts}
    if arch.expert_mlp_dim != arch.mlp_dim:
        moe["mlp_dim"] = arch.expert_mlp_dim
    moe["bfloat16_dispatch"] = bool(settings["bfloat16_dispatch"])
    if settings.get("dispatch"):
        moe["dispatch"] = settings["dispatch"]
    if arch.moe_kind == "soft":
        moe.update(type="soft", num_slots=arch.num_slots)
    else:
        moe["type"] = "partitioned" if arch.moe_kind == "partitioned" else "sparse"
        router: dict[str, Any] = {"name": settings["router"]}
        for key in ("num_selected_experts", "capacity_factor", "batch_priority",
                    "capacity_ceil_or_round", "capacity_multiple_of"):
            if key in settings:
                router[key] = settings[key]
        moe["router"] = router
        moe["group_size"] = settings["group_size"]
        moe["images_per_group"] = settings["images_per_group"]
        if settings.get("eval_routing"):
            moe["eval_routing"] = dict(settings["eval_routing"])
    config["moe"] = moe
    return config
