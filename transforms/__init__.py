"""Source transforms applied to the pinned vLLM 0.32.0 tree.

Each transform lives in its own module and exports ``TRANSFORM``. ``ORDER``
is the fixed order the engine applies them in; the lock records it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from transforms.edits import Edit, EditError


@dataclass(frozen=True)
class Transform:
    """One source transform: its edits per target file, and its contract note."""

    id: str
    why: str
    what_changes: str
    removal_plan: str
    # kv_connector_extra_config key -> meaning; every transform is opt-in.
    config_keys: Mapping[str, str]
    edits: Mapping[str, tuple[Edit, ...]] = field(default_factory=dict)


def class_default(cls: str, attribute: str, transform_id: str) -> Edit:
    """``attribute = None`` in cls's body, beside the ``self.attribute`` the transform's
    ``__init__`` edit sets: an object built without that ``__init__`` (``object.__new__(cls)`` as
    upstream's tests do, a subclass with its own ``__init__``) reads None at every call site, as
    with the option absent, instead of raising AttributeError."""
    return Edit(
        function=cls,
        mode="append_to_class",
        new=f"{attribute} = None  # sparkcache {transform_id}: class default; __init__ sets it",
    )


def all_transforms() -> tuple[Transform, ...]:
    """The transforms in the fixed order they are applied."""
    from transforms import checkpoint_retention, lease_accounting, prefer_local_prefix

    return (
        lease_accounting.TRANSFORM,
        prefer_local_prefix.TRANSFORM,
        checkpoint_retention.TRANSFORM,
    )


__all__ = ["Edit", "EditError", "Transform", "all_transforms", "class_default"]
