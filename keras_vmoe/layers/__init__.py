"""Mixture-of-Experts layers: routers, dispatchers, experts and MoE layers."""

from keras_vmoe.layers.capacity import compute_capacity
from keras_vmoe.layers.experts import Experts
from keras_vmoe.layers.moe_layer import MoeLayer
from keras_vmoe.layers.partitioned_moe import PartitionedMoE
from keras_vmoe.layers.partitioned_moe import tile_for_ensemble
from keras_vmoe.layers.routing import ExpertChoiceRouter
from keras_vmoe.layers.routing import PartitionedTokenChoiceRouter
from keras_vmoe.layers.routing import RenormalizedTokenChoiceRouter
from keras_vmoe.layers.routing import Router
from keras_vmoe.layers.routing import Routing
from keras_vmoe.layers.routing import SoftRouter
from keras_vmoe.layers.routing import TokenChoiceRouter
from keras_vmoe.layers.soft_moe import SoftMoE

__all__ = [
    "ExpertChoiceRouter",
    "Experts",
    "MoeLayer",
    "PartitionedMoE",
    "PartitionedTokenChoiceRouter",
    "RenormalizedTokenChoiceRouter",
    "Router",
    "Routing",
    "SoftMoE",
    "SoftRouter",
    "TokenChoiceRouter",
    "compute_capacity",
    "tile_for_ensemble",
]
