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


def all_transforms() -> tuple[Transform, ...]:
    """The transforms in the fixed order they are applied."""
    from transforms import checkpoint_retention, lease_accounting, prefer_local_prefix

    return (
        lease_accounting.TRANSFORM,
        prefer_local_prefix.TRANSFORM,
        checkpoint_retention.TRANSFORM,
    )


__all__ = ["Edit", "EditError", "Transform", "all_transforms"]
