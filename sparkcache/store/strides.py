"""Which of an entry's block keys are indexed, and the bisection that finds the deepest one of a
prompt that is stored.

Block keys are chained hashes (a key names its whole prefix), so an entry is found by the keys
at a few positions only: its first, then every ``STRIDE``-th. The local block index
(``index.EntryIndex``) holds those; the shared tier's pointers (``remote_keys``) are the same
positions' keys. Whoever asks "is the key at position p stored?" gives ``deepest_indexed`` that
question; it asks it about log2(n / STRIDE) times.
"""

from __future__ import annotations

from typing import Callable

STRIDE = 16  # besides its first, every STRIDE-th block key of an entry is indexed


def indexed_positions(n: int) -> list[int]:
    """The positions of an entry's ``n`` keys that are indexed: 0, STRIDE-1, 2*STRIDE-1, ..."""
    return [0, *range(STRIDE - 1, n, STRIDE)] if n > STRIDE - 1 else [0]


def deepest_indexed(n: int, stored: Callable[[int], bool]) -> int:
    """The largest indexed position p below ``n`` for which ``stored(p)``, or -1: bisection,
    which is right when what is stored is prefix-closed (every shorter indexed position of a
    stored one is stored too, as chained keys make it)."""
    if n <= 0 or not stored(0):
        return -1
    at = lambda i: i * STRIDE - 1 if i else 0  # noqa: E731  (stride i's position)
    lo, hi = 0, n // STRIDE  # stride lo is stored; stride hi + 1 would be past the end
    if hi and stored(at(hi)):
        return at(hi)
    while hi - lo > 1:  # stride hi is not stored
        mid = (lo + hi) // 2
        if stored(at(mid)):
            lo = mid
        else:
            hi = mid
    return at(lo)


def deepest_indexed_rounds(n: int, stored_many: Callable[[list[int]], list[bool]], k: int) -> int:
    """``deepest_indexed``, asking up to ``k`` positions a round (``stored_many`` asks them at
    once and answers each): the same answer where what is stored is prefix-closed, in about
    log(n / STRIDE) / log(k + 1) rounds, and never a position found not stored. The first round
    asks the first position (nothing is stored without it), the last (a prompt stored whole is
    found in that one round) and ``k - 2`` between; each later one splits what is left into
    ``k + 1`` parts. ``k`` of 1 is ``deepest_indexed``'s bisection."""
    if k <= 1:
        return deepest_indexed(n, lambda p: stored_many([p])[0])
    positions = indexed_positions(n) if n > 0 else []
    lo, hi = -1, len(positions)  # positions[lo] is stored (-1: none known); positions[hi] is not
    while hi - lo > 1:
        if lo < 0 and hi == len(positions):
            probes = sorted({0, hi - 1, *(round(j * (hi - 1) / (k - 1)) for j in range(1, k - 1))})
        else:
            probes = sorted({lo + round(j * (hi - lo) / (k + 1)) for j in range(1, k + 1)} - {lo, hi})
        answers = stored_many([positions[i] for i in probes])
        absent = [i for i, yes in zip(probes, answers) if not yes]
        hi = min(absent, default=hi)
        lo = max((i for i, yes in zip(probes, answers) if yes and i < hi), default=lo)
    return positions[lo] if lo >= 0 else -1


__all__ = ["STRIDE", "deepest_indexed", "deepest_indexed_rounds", "indexed_positions"]
