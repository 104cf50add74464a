"""Clock steps: leases and TTL on real pin files, real manifests and real mtimes while the
reader's or the maintainer's wall clock is 2 minutes or 1 hour behind, 1 hour or 10 years
ahead, or the host's clock stepped between a pin's write and a pass.

A process whose wall clock is off is this process with ``time.time`` patched while it acts
(the kernel's clock, which stamps mtimes, is not changed). A step of the host's clock is
the same thing seen from the files: what was written before the step carries mtimes off by
the step from the kernel's time now, so those files' mtimes are shifted (``os.utime``).
"""

from __future__ import annotations

import os
import time

import pytest

from sparkcache.store import PassBudget, run_pass
from store_helpers import IDENT, conv_keys, conv_pages, open_store, stopped_clock

REAL_TIME = time.time
MINUTES_2, HOUR, YEARS_10 = 120.0, 3600.0, 10 * 365.25 * 86400.0
BUDGET = PassBudget(max_entries=100, max_bytes=1 << 30, max_ms=5000)


def _store(root, **kw):
    # each entry: one 4 KiB page + one manifest block = 8 KiB; 11 entries are over max
    kw.setdefault("max_bytes", 80 * 1024)
    kw.setdefault("low_watermark_bytes", 40 * 1024)
    kw.setdefault("lease_seconds", 300)
    return open_store(root, page_blocks=16, **kw)


def _fill(store, convs) -> dict[int, str]:
    """Publish the conversations; their manifests' paths (read without a lookup, which
    would record an access)."""
    paths = {}
    for conv in convs:
        result = store.publish(IDENT, conv_keys(conv, 16), conv_pages(conv, 16, 16))
        assert result.ok
        paths[conv] = store.entry(result.entry_id).path
    return paths


def _shift_mtime(path: str, seconds: float) -> None:
    st = os.lstat(path)
    os.utime(path, (st.st_atime + seconds, st.st_mtime + seconds), follow_symlinks=False)


def _pins(store) -> list[str]:
    return sorted(n for n in os.listdir(store.layout.pins_dir) if n.endswith(".pin"))


def _hit(store, conv) -> bool:
    return store.lookup(IDENT, conv_keys(conv, 16)).hit


def _set_wall(monkeypatch, offset: float) -> None:
    """This process's wall clock ``offset`` seconds off the kernel's (as another host's)."""
    monkeypatch.setattr(time, "time", lambda: REAL_TIME() + offset)


def _leased_oldest(tmp_path, **kw):
    """11 entries over max; conversation 0 leased (a live 300 s pin) and the least recently
    used: the first a pass would evict but for the pin."""
    store = _store(tmp_path, **kw)
    paths = _fill(store, range(11))
    lease = store.lookup(IDENT, conv_keys(0, 16), lease=True)
    assert lease.lease_id and _pins(store)
    for conv in range(11):
        _shift_mtime(paths[conv], -(100 - conv) - (1000 if conv == 0 else 0))
    return store, lease, paths


# ----------------------------------------------------------------------------- leases


@pytest.mark.parametrize("offset", [-MINUTES_2, -HOUR, HOUR, YEARS_10],
                         ids=["2min_behind", "1h_behind", "1h_ahead", "10y_ahead"])
def test_a_maintainer_with_its_clock_off_keeps_a_live_lease(tmp_path, monkeypatch, offset):
    store, lease, paths = _leased_oldest(tmp_path)
    pin = _pins(store)
    with monkeypatch.context() as m:
        _set_wall(m, offset)
        report = run_pass(store, BUDGET, timer=stopped_clock)
    assert report.pinned_skipped == 1, report
    assert _pins(store) == pin, "the live pin was removed"
    assert _hit(store, 0), "the leased entry was evicted"
    assert report.used_bytes_after <= 40 * 1024  # the others were evicted as usual
    store.release(lease.lease_id)


@pytest.mark.parametrize("step", [-MINUTES_2, -HOUR, HOUR, YEARS_10],
                         ids=["2min_back", "1h_back", "1h_forward", "10y_forward"])
def test_a_host_clock_step_after_the_pin_keeps_the_lease(tmp_path, step):
    """The host's clock stepped by ``step`` after the reader pinned: the pin's and the
    manifests' mtimes are off by ``-step`` from the kernel's time now."""
    store, lease, paths = _leased_oldest(tmp_path)
    pin = _pins(store)
    for name in pin:
        _shift_mtime(os.path.join(store.layout.pins_dir, name), -step)
    for path in paths.values():
        _shift_mtime(path, -step)
    report = run_pass(store, BUDGET, timer=stopped_clock)
    assert report.pinned_skipped == 1, report
    assert _pins(store) == pin, "the live pin was removed"
    assert _hit(store, 0), "the leased entry was evicted"
    store.release(lease.lease_id)


# ----------------------------------------------------------------------------- TTL


def _ttl_store(tmp_path):
    """Conversation 1 unused for 120 s, 0 and 2 just used; TTL 60 s."""
    store = _store(tmp_path, ttl_seconds=60, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    paths = _fill(store, range(3))
    _shift_mtime(paths[1], -120)
    return store


@pytest.mark.parametrize("offset", [-MINUTES_2, -HOUR, HOUR, YEARS_10],
                         ids=["2min_behind", "1h_behind", "1h_ahead", "10y_ahead"])
def test_ttl_is_judged_on_the_filesystems_clock_not_the_maintainers(tmp_path, monkeypatch, offset):
    store = _ttl_store(tmp_path)
    with monkeypatch.context() as m:
        _set_wall(m, offset)
        report = run_pass(store, BUDGET, timer=stopped_clock)
    assert report.entries_expired == 1, report
    assert [c for c in range(3) if _hit(store, c)] == [0, 2]


def test_a_reader_far_ahead_cannot_make_an_entry_immune_to_the_ttl(tmp_path, monkeypatch):
    store = _store(tmp_path, ttl_seconds=60, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    paths = _fill(store, range(2))
    with monkeypatch.context() as m:
        _set_wall(m, YEARS_10)  # a reader 10 years ahead reads conversation 1
        assert _hit(store, 1)
    stamped = os.lstat(paths[1]).st_mtime
    for path in paths.values():  # then neither is read for 120 s
        _shift_mtime(path, -120)
    report = run_pass(store, BUDGET, timer=stopped_clock)
    assert report.entries_expired == 2, report
    assert not _hit(store, 0) and not _hit(store, 1)
    assert stamped <= REAL_TIME() + 1, "the reader stamped its own clock's time as the access"


def test_an_entry_stamped_in_the_future_counts_as_used_now_and_then_ages(tmp_path):
    """A manifest mtime 10 years ahead (an older reader's clock, or forged) is not immune: a
    pass counts it as used now and re-stamps it with the kernel's time, so it ages from
    there (the TTL takes it once it is unused for longer than the TTL)."""
    store = _store(tmp_path, ttl_seconds=60, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    path = _fill(store, range(2))[1]
    _shift_mtime(path, YEARS_10)
    report = run_pass(store, BUDGET, timer=stopped_clock)
    assert report.entries_expired == 0, report  # counted as used now
    assert os.lstat(path).st_mtime <= REAL_TIME() + 1, "not re-stamped with the kernel's time"
    _shift_mtime(path, -120)  # unused for 120 s since
    report = run_pass(store, BUDGET, timer=stopped_clock)
    assert report.entries_expired == 1, report
    assert _hit(store, 0) and not _hit(store, 1)
