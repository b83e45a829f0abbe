"""`PhaseRouting`: the checked routing settings of training or of evaluation."""

import dataclasses

from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.utils.validation import MAX_GROUP_CHOICES
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_int

# Expert Choice routers have only `capacity_factor`.
ROUTER_SETTINGS = ("num_selected_experts", "capacity_factor", "batch_priority")
# At most one is set; both `None` routes a call's tokens as one group.
GROUP_SETTINGS = ("group_size", "images_per_group")
SETTINGS = ROUTER_SETTINGS + GROUP_SETTINGS


@dataclasses.dataclass(frozen=True)
class PhaseRouting:
    """The routing settings of one phase of an `MoeLayer`, checked.

    `None` for a router setting means the router has no such setting.

    Attributes:
        num_selected_experts: int K >= 1, experts per token.
        capacity_factor: float > 0.
        batch_priority: bool, Batch Prioritized Routing.
        group_size: int S >= 1, tokens routed jointly.
        images_per_group: int >= 1, examples routed jointly.

    Examples:

    >>> train = PhaseRouting(num_selected_experts=2, capacity_factor=1.05)
    >>> train.replace(capacity_factor=4).capacity_factor
    4.0
    >>> train.replace(images_per_group=8).overrides_of(train)
    {'group_size': None, 'images_per_group': 8}
    """

    num_selected_experts: int | None = None
    capacity_factor: float | None = None
    batch_priority: bool | None = None
    group_size: int | None = None
    images_per_group: int | None = None

    def __post_init__(self):
        checks = {"capacity_factor": validate_capacity_factor,
                  "batch_priority": check_bool}
        checked = {}
        for name in SETTINGS:
            value, check = getattr(self, name), checks.get(name)
            if check is None:  # the int settings
                checked[name] = check_int(value, name, allow_none=True)
            else:
                checked[name] = None if value is None else check(value, name)
        if checked["group_size"] is not None and checked["images_per_group"] is not None:
            raise ValueError(
                "Set at most one of `group_size` (tokens) and `images_per_group`. "
                f"Received: group_size={self.group_size!r}, "
                f"images_per_group={self.images_per_group!r}"
            )
        group_size, k = checked["group_size"], checked["num_selected_experts"] or 1
        if group_size is not None and group_size * k > MAX_GROUP_CHOICES:
            raise ValueError(
                f"`group_size={group_size}` with num_selected_experts={k} makes more "
                f"token choices per group than the routing's int32 indices count "
                f"({MAX_GROUP_CHOICES}): `group_size` must be at most "
                f"{MAX_GROUP_CHOICES // k}.")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes):
        """These settings with `changes`, checked; setting one group setting
        clears the other."""
        unknown = sorted(set(changes) - set(SETTINGS))
        if unknown:
            raise ValueError(
                f"Unknown routing settings {unknown}. Valid: {list(SETTINGS)}. "
                f"Received: {changes!r}"
            )
        if any(name in changes for name in GROUP_SETTINGS):
            changes = {**dict.fromkeys(GROUP_SETTINGS), **changes}
        return dataclasses.replace(self, **changes)

    def overrides_of(self, base):
        """The settings that differ from `base` (the group pair whole)."""
        out = {
            name: getattr(self, name) for name in ROUTER_SETTINGS
            if getattr(self, name) != getattr(base, name)
        }
        if any(getattr(self, name) != getattr(base, name) for name in GROUP_SETTINGS):
            out.update({name: getattr(self, name) for name in GROUP_SETTINGS})
        return out

    def check_router(self, router, where="routing"):
        """`self` if `router` has every setting set here, within its range;
        `where` names the settings in the messages."""
        for name in ("num_selected_experts", "batch_priority"):
            value = getattr(self, name)
            if value is not None and not hasattr(router, name):
                raise ValueError(
                    f"The router {type(router).__name__} has no `{name}` setting "
                    f"({where}). Received: {name}={value!r}"
                )
        limit = getattr(router, "experts_per_choice_set", None)
        if self.num_selected_experts is not None and limit is not None:
            check_int(self.num_selected_experts, "num_selected_experts", maximum=limit)
        return self

    @classmethod
    def of_router(cls, router, group_size=None, images_per_group=None):
        """The settings `router` routes with, and the given groups."""
        return cls(
            num_selected_experts=getattr(router, "num_selected_experts", None),
            capacity_factor=router.capacity_factor,
            batch_priority=getattr(router, "batch_priority", None),
            group_size=group_size,
            images_per_group=images_per_group,
        )
