"""Routers (being split by router family; see `base`)."""

from keras_vmoe.layers.routing.base import *  # noqa: F401,F403
from keras_vmoe.layers.routing.base import MAX_ITERATIONS  # noqa: F401
from keras_vmoe.layers.routing.base import ROUTERS  # noqa: F401
from keras_vmoe.layers.routing.base import ExpertChoiceRouter  # noqa: F401
from keras_vmoe.layers.routing.base import PartitionedTokenChoiceRouter  # noqa: F401
from keras_vmoe.layers.routing.base import Router  # noqa: F401
from keras_vmoe.layers.routing.base import Routing  # noqa: F401
from keras_vmoe.layers.routing.base import SoftRouter  # noqa: F401
from keras_vmoe.layers.routing.base import TokenChoiceRouter  # noqa: F401
from keras_vmoe.layers.routing.base import check_router  # noqa: F401
from keras_vmoe.layers.routing.base import get_router  # noqa: F401
