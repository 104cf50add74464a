"""Exact per-request attribution of prompt tokens: local hit, verified external, recomputed.

The record describes the admission that completed the prompt's prefill (the path whose
KV the first output token was computed from):

- ``local_hit_tokens``: prompt tokens found in vLLM's local prefix cache at that admission;
- ``external_tokens``: prompt tokens restored by sparkcache and *consumed* (the worker
  reported the load finished without failure and the request was scheduled on them);
- ``recomputed_tokens``: the rest of the prompt, computed by the model.

The three sum to ``prompt_tokens``. ``input`` says what the prompt was made of (``InputKind``:
``text``, ``multimodal`` when it carries images or other multimodal items, ``prompt_embeds``),
so the restored tokens of image turns can be told from the rest. ``remote_tokens`` is the part
of ``external_tokens`` restored from an entry the scheduler fetched from the shared tier
(``SPARKCACHE_REMOTE_BUCKET``; docs/REMOTE.md) for this request: 0 when the restore read an
entry the local store held already. A preemption before the prefill completes starts a new
admission (counted in ``preemptions``); a failed restore is counted in ``failed_restores``
and its tokens are recomputed. ``complete`` is False (with ``reason``) when the prefill
never completed (aborted, or finished while a restore was in flight): then the numbers
are those of the last admission and ``recomputed_tokens`` holds what was left to compute.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM's types, for readers and type checkers; never imported at run time here
    from vllm.v1.request import Request

logger = logging.getLogger("sparkcache.attribution")

LOG_PREFIX = "sparkcache-attribution "


class InputKind(str, Enum):
    """What a request's prompt is made of, beside token ids (its KV depends on it too)."""
    TEXT = "text"
    MULTIMODAL = "multimodal"        # images (or other multimodal items) among its tokens
    PROMPT_EMBEDS = "prompt_embeds"  # embeddings given instead of token ids

    @classmethod
    def of(cls, request: Request) -> "InputKind":
        if request.prompt_embeds is not None:
            return cls.PROMPT_EMBEDS
        return cls.MULTIMODAL if request.mm_features else cls.TEXT


@dataclass
class AttributionRecord:
    request_id: str
    prompt_tokens: int
    local_hit_tokens: int = 0
    external_tokens: int = 0
    recomputed_tokens: int = 0
    complete: bool = False
    reason: str = "not_admitted"
    preemptions: int = 0
    failed_restores: int = 0
    admissions: int = 0
    remote_tokens: int = 0  # of external_tokens: restored from an entry fetched from the shared tier
    input: InputKind = InputKind.TEXT
    prefill_done: bool = field(default=False, repr=False)

    def admit(self, computed_at_admission: int, consumed_external: int, *, resumed: bool = False,
              remote: bool = False) -> None:
        """A (re-)admission that schedules tokens with ``computed_at_admission`` computed;
        ``remote``: its restore reads an entry the scheduler fetched from the shared tier."""
        if self.prefill_done:
            return
        if resumed:
            self.preemptions += 1
        p = self.prompt_tokens
        computed = min(computed_at_admission, p)
        external = min(max(consumed_external, 0), computed)
        self.admissions += 1
        self.local_hit_tokens = computed - external
        self.external_tokens = external
        self.remote_tokens = external if remote else 0
        self.recomputed_tokens = p - computed
        self.reason = "prefill_running"

    def restore_undone(self, tokens: int) -> None:
        """A synchronous restore admitted with ``tokens`` external tokens failed: nothing was
        placed, vLLM recomputes them (and discards the step's output)."""
        tokens = min(max(tokens, 0), self.external_tokens)
        self.external_tokens -= tokens
        self.remote_tokens = min(self.remote_tokens, self.external_tokens)
        self.recomputed_tokens += tokens
        if self.prefill_done:
            self.prefill_done = self.complete = False
            self.reason = "prefill_running"

    def mark_prefill_done(self) -> None:
        if not self.prefill_done and self.admissions:
            self.prefill_done = True
            self.complete = True
            self.reason = "ok"

    def finish(self, status: str, input_kind: InputKind = InputKind.TEXT) -> "AttributionRecord":
        """The record at the request's end; ``input_kind`` as it ended (a streaming session
        can add images to a request)."""
        self.input = input_kind
        if not self.prefill_done:
            self.complete = False
            if self.admissions == 0:
                self.recomputed_tokens = self.prompt_tokens
            self.reason = f"finished_before_prefill:{status}"
        assert self.local_hit_tokens + self.external_tokens + self.recomputed_tokens == self.prompt_tokens
        return self

    def public(self) -> dict:
        d = asdict(self)
        d.pop("prefill_done")
        d["input"] = self.input.value
        return d


def emit(record: AttributionRecord) -> str:
    line = LOG_PREFIX + json.dumps(record.public(), sort_keys=True)
    logger.info(line)
    return line
