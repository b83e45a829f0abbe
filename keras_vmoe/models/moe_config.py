"""The `moe` dict of an encoder block: `validate_moe_config` checks it before any
layer is built; `make_moe_layer` builds the `MoeLayer`, `PartitionedMoE` or
`SoftMoE` it describes.
"""

from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.layers.moe_layer import MoeLayer
from keras_vmoe.layers.partitioned_moe import PartitionedMoE
from keras_vmoe.layers.soft_moe import SoftMoE

MOE_TYPES = ("sparse", "soft", "partitioned")
MOE_KEYS = (
    "type", "num_experts", "mlp_dim", "router", "group_size", "images_per_group",
    "eval_routing", "num_slots", "capacity_factor", "noise_std", "bfloat16_dispatch",
    "dropout_rate", "identical_init", "dispatch",
)


def validate_moe_config(moe, ensemble_size=1):
    """Checks a backbone/encoder-block `moe` dict; returns its MoE type."""
    if not isinstance(moe, dict):
        raise ValueError(f"`moe` must be a dict. Received: moe={moe!r}")
    unknown = sorted(set(moe) - set(MOE_KEYS))
    if unknown:
        raise ValueError(f"Unknown `moe` keys {unknown}. Valid keys: {list(MOE_KEYS)}.")
    moe_type = moe.get("type", "sparse")
    if moe_type not in MOE_TYPES:
        raise ValueError(
            f"`moe['type']` must be one of {MOE_TYPES}. Received: {moe_type!r}"
        )
    num_experts = moe.get("num_experts")
    if (
        not isinstance(num_experts, int)
        or isinstance(num_experts, bool)
        or num_experts < 1
    ):
        raise ValueError(
            "`moe['num_experts']` must be an integer >= 1. "
            f"Received: num_experts={num_experts!r}"
        )
    if ensemble_size > 1:
        if moe_type == "soft":
            raise ValueError(
                "E³ ensembles (ensemble_size > 1) need sparse Token Choice MoE "
                "layers; moe['type']='soft' is not supported with "
                f"ensemble_size={ensemble_size}."
            )
        if num_experts % ensemble_size:
            raise ValueError(
                f"`moe['num_experts']` ({num_experts}) must be divisible by "
                f"`ensemble_size` ({ensemble_size}): every ensemble member owns "
                "E/ensemble_size experts. Valid ensemble sizes divide "
                f"{num_experts}."
            )
        moe_type = "partitioned"
    router = moe.get("router")
    for label, value in (
        ("moe['router']['capacity_factor']",
         router.get("capacity_factor") if isinstance(router, dict) else None),
        ("moe['capacity_factor']", moe.get("capacity_factor")),
    ):
        if value is not None:
            validate_capacity_factor(value, name=label)
    if moe.get("group_size") is not None and moe.get("images_per_group") is not None:
        raise ValueError(
            "Set at most one of moe['group_size'] (tokens) and "
            "moe['images_per_group']. Received: "
            f"group_size={moe['group_size']!r}, "
            f"images_per_group={moe['images_per_group']!r}"
        )
    eval_routing = moe.get("eval_routing")
    if eval_routing is not None:
        if moe_type == "soft" and eval_routing:
            raise ValueError(
                "Soft MoE layers have a fixed routing; moe['eval_routing'] does not "
                f"apply. Received: eval_routing={eval_routing!r}"
            )
        if not isinstance(eval_routing, dict):
            raise ValueError(
                "moe['eval_routing'] must be a dict of routing settings, e.g. "
                f"{{'capacity_factor': 4.0}}. Received: {eval_routing!r}"
            )
        if eval_routing.get("capacity_factor") is not None:
            validate_capacity_factor(
                eval_routing["capacity_factor"],
                name="moe['eval_routing']['capacity_factor']",
            )
    if moe_type == "partitioned":
        router = moe.get("router") or {}
        name = router.get("name", "token_choice") if isinstance(router, dict) else None
        if name not in ("token_choice", "softmax_token_choice"):
            raise ValueError(
                "Partitioned (E³) MoE layers use the softmax Token Choice router; "
                f"moe['router']['name'] must be 'token_choice'. Received: {name!r}"
            )
    return moe_type


def make_moe_layer(
    moe, mlp_dim, ensemble_size=1, dropout_rate=0.0, activation="gelu_tanh",
    name="moe", dtype=None
):
    """The `MoeLayer`, `PartitionedMoE` (`ensemble_size > 1`) or `SoftMoE` a
    backbone `moe` dict describes; `mlp_dim` and `dropout_rate` are defaults."""
    moe_type = validate_moe_config(moe, ensemble_size)
    common = dict(
        num_experts=moe["num_experts"],
        mlp_dim=moe.get("mlp_dim") or mlp_dim,
        dropout_rate=moe.get("dropout_rate", dropout_rate),
        identical_init=moe.get("identical_init", True),
        # Soft MoE: bf16 by default, as upstream's always-bf16 dispatcher.
        bfloat16_dispatch=moe.get("bfloat16_dispatch", moe_type == "soft"),
        activation=activation,
        name=name,
        dtype=dtype,
    )
    router = dict(moe.get("router") or {})
    if moe_type == "soft":
        return SoftMoE(
            num_slots=moe.get("num_slots", 1),
            capacity_factor=moe.get("capacity_factor", 1.0),
            noise_std=moe.get("noise_std", 0.0),
            **common,
        )
    sparse = dict(
        group_size=moe.get("group_size"),
        images_per_group=moe.get("images_per_group"),
        eval_routing=moe.get("eval_routing"),
        dispatch=moe.get("dispatch", "index"),
    )
    if moe_type == "partitioned":
        router.pop("name", None)
        return PartitionedMoE(
            num_partitions=ensemble_size, router=router, **sparse, **common
        )
    return MoeLayer(router=router or "token_choice", **sparse, **common)
