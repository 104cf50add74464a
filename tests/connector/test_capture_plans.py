"""Where captures happen and what they copy (``capture_plans``), case by case: vLLM's state
offers, the prompt boundary a window layout captures at, a window vLLM already freed, a
drafter's lower boundary, pages an entry already holds. The real scheduler and worker around
it: ``test_field_restore_scheduler.py`` and the engine lives."""

from __future__ import annotations

import pytest

from sparkcache.connector.capture_plans import NULL_BLOCK_ID, CapturePlanner
from sparkcache.connector.kv_layout import KVLayout, LayoutKind

BS = 16


def _planner(layout: KVLayout, stored: int = 0, stored_with_state: int = 0, page_blocks: int = 2) -> CapturePlanner:
    return CapturePlanner(layout, BS, page_blocks, 3, 32,
                          lambda keys, with_state: min(len(keys), stored_with_state if with_state else stored))


HYBRID = KVLayout(LayoutKind.HYBRID, "{}", (0,), (1, 2))
WINDOWED = KVLayout(LayoutKind.HYBRID, "{}", (0,), (), window_groups=(2,), window_blocks=(2,))
DRAFTED = KVLayout(LayoutKind.HYBRID, "{}", (0,), (1, 2), lookahead=1)


@pytest.mark.parametrize("layout,prompt,offers,want", [
    # 100 tokens: the prompt boundary is 96 (block 6); an offer there in both groups is taken
    (HYBRID, 100, [(1, 7, 96), (2, 8, 96)], [(6, [7, 8])]),
    # below the prompt boundary, not on a block boundary, or in one recurrent group only: not
    (HYBRID, 100, [(1, 7, 80), (2, 8, 80), (1, 9, 90), (2, 9, 90), (1, 5, 96)], []),
    # a decode-time checkpoint past the prompt is taken too
    (HYBRID, 100, [(1, 7, 96), (2, 8, 96), (1, 3, 128), (2, 4, 128)], [(6, [7, 8]), (8, [3, 4])]),
    # a drafter: vLLM keeps the state one block lower, and that is taken
    (DRAFTED, 100, [(1, 7, 80), (2, 8, 80)], [(5, [7, 8])]),
])
def test_offered_boundaries(layout, prompt, offers, want):
    assert _planner(layout).offered_boundaries(prompt, offers) == want


@pytest.mark.parametrize("before,scheduled,want", [(0, 100, 6), (0, 96, 6), (0, 95, None), (96, 4, None),
                                                    (80, 16, 6), (95, 1, 6)])
def test_a_window_layout_captures_in_the_step_computing_past_the_prompt_boundary(before, scheduled, want):
    assert _planner(WINDOWED).crossed_prompt_boundary(100, before, scheduled) == want


def test_a_boundary_plan_copies_new_pages_the_state_and_the_window():
    table = ([10, 11, 12, 13, 14, 15], [0, 0, 0, 0, 0, 0], [NULL_BLOCK_ID] * 4 + [24, 25])
    keys = [f"k{i}" for i in range(6)]
    plan = _planner(WINDOWED, stored=3).at_boundary("r", keys, table, 6, [])
    assert plan.reuse_pages == 1 and plan.block_ids == [[12, 13, 14, 15], [], []]  # one page of 2 reused
    assert plan.state_block_ids == [] and plan.window_block_ids == [[24, 25]]
    # vLLM freed a block of the window: nothing to capture at that boundary
    freed = (table[0], table[1], [NULL_BLOCK_ID] * 5 + [25])
    assert _planner(WINDOWED).at_boundary("r", keys, freed, 6, []) is None
    # already held with its boundary object by every rank, too short, or a key missing: no plan
    assert _planner(WINDOWED, stored=6, stored_with_state=6).at_boundary("r", keys, table, 6, []) is None
    assert _planner(WINDOWED).at_boundary("r", keys[:1], table, 1, []) is None
    assert _planner(WINDOWED).at_boundary("r", keys[:5], table, 6, []) is None


def test_a_finish_plan_stops_where_the_keys_do_and_skips_what_is_held():
    attention = KVLayout(LayoutKind.ATTENTION, "{}", (0,), ())
    table = ([10, 11, 12, 13, 14, 15], [], [])
    keys = [f"k{i}" for i in range(6)]
    plan = _planner(attention).at_finish("r", lambda n: keys[:n - 1], 100, table)  # a lookahead token missing
    assert plan.keys == keys[:5] and plan.block_ids[0] == [10, 11, 12, 13, 14] and plan.state_block_ids is None
    assert _planner(attention, stored=5).at_finish("r", lambda n: keys[:n - 1], 100, table) is None
    assert _planner(attention).at_finish("r", lambda n: keys[:n], 20, table) is None  # under the minimum span
