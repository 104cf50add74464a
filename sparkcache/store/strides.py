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


__all__ = ["STRIDE", "deepest_indexed", "indexed_positions"]
