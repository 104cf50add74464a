"""Rank-local, content-addressed, crash-safe page store (see pagestore.py for the API)."""

from .identity import Identity, block_key, entry_id_for
from .maintenance import MaintenanceThread, PassBudget, PassReport, pass_due, run_pass
from .manifests import Manifest, PageRef
from .backend import ObjectError
from .pagestore import PageStore
from .reasons import Reason
from .results import (CapacitySnapshot, EntryHandle, LookupResult, PublishResult, ReadResult,
                      RecoveryReport)
from .units import IncompleteUnit, incomplete_units, shard_units
from .verify import Problem, VerifyReport, verify_store

__all__ = [
    "CapacitySnapshot", "EntryHandle", "Identity", "IncompleteUnit", "LookupResult", "MaintenanceThread",
    "Manifest", "ObjectError", "PageRef", "PageStore", "PassBudget", "PassReport", "Problem", "PublishResult",
    "ReadResult", "Reason", "RecoveryReport", "VerifyReport", "block_key", "entry_id_for", "incomplete_units",
    "pass_due", "run_pass", "shard_units", "verify_store",
]
