"""Scheduler and Mamba managers built without their (transformed) ``__init__``.

The transforms' call sites read ``self.sparkcache_*`` (Scheduler: ``sparkcache_leases``,
``sparkcache_prefer_local_prefix``; MambaManager: ``sparkcache_retired``,
``sparkcache_decode_checkpoints``), which the transformed ``__init__`` sets. An object made
without that ``__init__`` (upstream's tests build ``object.__new__(Scheduler)`` and fill in the
fields they need; a subclass may override ``__init__``) must still pass through every call site:
the class-level defaults (None) the transforms add make the reads fall through to upstream
behaviour instead of raising AttributeError.

A real Scheduler is built (with every transform's option when ``options_on``), then copied field
by field into ``object.__new__(Scheduler)`` without its ``sparkcache_*`` attributes, and likewise
each Mamba manager in the coordinator. The copy runs an 80-token hybrid request that decodes 5
tokens (schedule, cache_blocks, the Mamba state retired during decode), finishes with its free
delayed by the ProbeConnector (``_free_request``), is released by ``finished_sending``
(``_update_from_kv_xfer_finished``, ``_free_blocks``, ``pop_blocks_for_free``), then
``make_stats``, then a second request repeating the conversation is admitted (the local-hit lookup
and the connector query). The result names the hooks the built objects had attached (and the copy
left out: none on the pristine tree or with the options off), each stage reached and the first
error, if any.
"""

from __future__ import annotations

from testing import vllm_scheduler as h
from testing.scenarios.growing_conversation import ALL_OPTIONS

PROMPT = list(range(100, 180))
MAX_TOKENS = 5
NEW_TOKENS = list(range(300, 332))
NUM_BLOCKS = 100
PREFIX = "sparkcache_"


def _copy_without_init(obj):
    """obj's class, made with ``object.__new__``, holding obj's fields except ``sparkcache_*``."""
    clone = object.__new__(type(obj))
    clone.__dict__.update({k: v for k, v in vars(obj).items() if not k.startswith(PREFIX)})
    return clone


def _stages(scheduler, passed: list[str]) -> None:
    first = h.make_request("turn1", PROMPT, MAX_TOKENS)
    h.run_to_completion(scheduler, first)
    passed.append("run_to_completion")
    h.step(scheduler, finished_sending={first.request_id})
    passed.append("finished_sending")
    scheduler.make_stats()
    passed.append("make_stats")
    second = h.make_request("turn2", list(first.all_token_ids) + NEW_TOKENS, MAX_TOKENS)
    h.first_schedule_hit(scheduler, second)
    passed.append("next_turn_admitted")


def run(options_on: bool) -> dict:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    extra = {"probe_delay_free": True, **(ALL_OPTIONS if options_on else {})}
    built = h.make_scheduler(h.probe_connector(extra), num_blocks=NUM_BLOCKS)
    scheduler = _copy_without_init(built)
    coordinator = scheduler.kv_cache_manager.coordinator
    attached = sorted({k for obj in (built, *coordinator.single_type_managers) for k, v in vars(obj).items()
                       if k.startswith(PREFIX) and v is not None})
    coordinator.single_type_managers = tuple(
        _copy_without_init(m) if isinstance(m, MambaManager) else m for m in coordinator.single_type_managers
    )
    passed: list[str] = []
    error = None
    try:
        _stages(scheduler, passed)
    except Exception as exc:  # the result names it: an AttributeError is what this scenario guards against
        error = f"{type(exc).__name__}: {exc}"
    return {
        "type": type(scheduler).__name__ if isinstance(scheduler, Scheduler) else None,
        "copied_managers": sorted(type(m).__name__ for m in coordinator.single_type_managers),
        "hooks_left_out": attached,
        "stages_passed": passed,
        "error": error,
    }
