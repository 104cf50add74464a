"""What a capture copies, decided on the scheduler from a request's block table: one place
for every layout's rule (``kv_layout``), apart from when the scheduler half asks
(``scheduler_side``) and how the workers copy (``worker_side``).

An entry of ``n`` blocks holds, for each page group, blocks ``[reuse_pages * page_blocks, n)``
(the leading pages an entry already holds are not copied again) and, for a layout with a
boundary object (``KVLayout.has_state``), the state vLLM offered for boundary ``n`` in each
recurrent group and the window before ``n`` in each window group. When:

- attention only: at the request's end, as deep as its computed blocks go
  (``at_finish``);
- recurrent state: at the boundaries vLLM offers a state for, from the prompt's last full
  block on (``offered_boundaries``);
- windows without recurrent state: at the prompt's last full block, in the step whose forward
  computes past it (``crossed_prompt_boundary``), while vLLM still holds the window.

A plan is made only when every rank does not already hold that depth (``stored_depth``) and
the blocks are the request's (a window column vLLM already freed holds its null block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .kv_layout import KVLayout

# vLLM's null block (``BlockPool.null_block``, the pool's first block): what a block table
# holds for a column the request no longer holds (behind a sliding window).
NULL_BLOCK_ID = 0


@dataclass
class CapturePlan:
    req_id: str
    keys: list[str]           # keys of blocks [0, n_blocks)
    reuse_pages: int          # leading pages an existing entry holds (published as None)
    block_ids: list[list[int]]  # per KV group: source block ids of [reuse_pages*bpp, n_blocks)
    # Hybrid: per recurrent group (``KVLayout.state_groups`` order), the block vLLM offered
    # with the state after n_blocks; copied after this step's forward. None: no boundary object.
    state_block_ids: list[int] | None = None
    # Hybrid: per window group (``KVLayout.window_groups`` order), the blocks of its window
    # before n_blocks (``KVLayout.windows_at``), copied with the state.
    window_block_ids: list[list[int]] | None = None


@dataclass(frozen=True)
class CapturePlanner:
    layout: KVLayout
    block_size: int
    page_blocks: int
    num_groups: int
    min_span_tokens: int
    # leading blocks of these keys every rank holds (``with_state``: ending in a boundary object)
    stored_depth: Callable[[list[str], bool], int]

    def prompt_boundary(self, prompt_tokens: int) -> int:
        """The deepest boundary a longer prompt resumes at: vLLM keeps no state after a
        prompt's last token (a hit never covers it), so a 704-token prompt's is 640."""
        return (prompt_tokens - 1) // self.block_size * self.block_size

    def offered_boundaries(self, prompt_tokens: int,
                           offers: Sequence[tuple[int, int, int]]) -> list[tuple[int, list[int]]]:
        """(blocks, state block per recurrent group) of each boundary vLLM offered a state for
        in every recurrent group (``boundary_state_offloads``: (group, block, tokens)), from
        the prompt boundary on; with a drafter one block lower (vLLM's own hits drop it:
        ``replay_boundaries``)."""
        by_boundary: dict[int, dict[int, int]] = {}
        for group, block_id, tokens in offers:
            by_boundary.setdefault(int(tokens), {})[int(group)] = int(block_id)
        lowest = self.prompt_boundary(prompt_tokens) - (self.block_size if self.layout.lookahead else 0)
        return [(tokens // self.block_size, [groups[g] for g in self.layout.state_groups])
                for tokens, groups in sorted(by_boundary.items())
                if not tokens % self.block_size and tokens >= max(lowest, 1)
                and set(groups) == set(self.layout.state_groups)]

    def crossed_prompt_boundary(self, prompt_tokens: int, computed_before: int, scheduled: int) -> int | None:
        """Blocks to the prompt boundary, when this step's forward computes past it."""
        boundary = self.prompt_boundary(prompt_tokens)
        return boundary // self.block_size if computed_before < boundary <= computed_before + scheduled else None

    def at_boundary(self, req_id: str, keys: list[str] | None, table: tuple[list[int], ...], n_blocks: int,
                    state_ids: list[int]) -> CapturePlan | None:
        """The plan for an entry of ``n_blocks`` ending at a boundary (``keys``: the request's
        first ``n_blocks`` keys, fewer when a key's lookahead token is unknown, None when it
        has none), copied after this step's forward from ``table``."""
        if n_blocks * self.block_size < self.min_span_tokens or keys is None or len(keys) < n_blocks:
            return None
        if any(len(table[g]) < n_blocks for g in self.layout.page_groups):
            return None
        spans = self.layout.windows_at(n_blocks)
        windows = [list(table[g][n_blocks - k:n_blocks]) for g, k in zip(self.layout.window_groups, spans)]
        if any(len(ids) != k or NULL_BLOCK_ID in ids for ids, k in zip(windows, spans)):
            return None  # vLLM no longer holds that window
        if self.stored_depth(keys, True) == n_blocks:
            return None  # every rank holds it, boundary object included
        return self._plan(req_id, keys, table, self.stored_depth(keys, False), state_ids, windows)

    def at_finish(self, req_id: str, keys_upto: Callable[[int], list[str] | None], computed_tokens: int,
                  block_ids: tuple[list[int], ...]) -> CapturePlan | None:
        """An attention-only layout's plan at the request's end: its computed whole blocks
        (``keys_upto(n)``: the request's first ``n`` keys, or None)."""
        n_blocks = min([computed_tokens // self.block_size, *(len(block_ids[g]) for g in self.layout.page_groups)])
        if n_blocks <= 0 or n_blocks * self.block_size < self.min_span_tokens:
            return None
        keys = keys_upto(n_blocks)
        # fewer where the tokens a key looks ahead at end first
        if not keys or len(keys) * self.block_size < self.min_span_tokens:
            return None
        depth = self.stored_depth(keys, False)
        if depth >= len(keys):
            return None  # every rank holds it
        return self._plan(req_id, keys, block_ids, depth, None, None)

    def _plan(self, req_id: str, keys: list[str], table: tuple[list[int], ...], stored: int,
              state_ids: list[int] | None, windows: list[list[int]] | None) -> CapturePlan:
        """``stored``: the leading blocks every rank holds (whole pages of them are reused)."""
        reuse_pages = stored // self.page_blocks
        first = reuse_pages * self.page_blocks
        ids = [list(table[g][first:len(keys)]) if g in self.layout.page_groups else []
               for g in range(self.num_groups)]
        return CapturePlan(req_id, keys, reuse_pages, ids, state_ids, windows)
