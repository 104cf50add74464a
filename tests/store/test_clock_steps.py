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

from sparkcache.store import PassBudget, pass_due, run_pass, verify_store
from sparkcache.store.clocks import SYSTEM_CLOCK, Clock
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
    found = store.lookup(IDENT, conv_keys(conv, 16)).hit
    store.accesses.flush()  # the hit's stamp, made off the lookup's thread (accesses.py)
    return found


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


def test_a_new_maintainer_far_ahead_with_a_link_for_a_pins_directory_expires_nothing(tmp_path, monkeypatch):
    """The pins directory replaced by a link: a new maintainer ten years ahead still reads
    the filesystem's clock (the link itself is stamped, never followed) or stops; it never
    falls back to its wall clock and expires every entry."""
    store = _store(tmp_path, ttl_seconds=60, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    _fill(store, range(2))
    pins = store.layout.pins_dir
    os.rename(pins, pins + ".moved")
    os.symlink(pins + ".moved", pins)
    with monkeypatch.context() as m:
        _set_wall(m, YEARS_10)
        maintainer = _store(tmp_path, ttl_seconds=60, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
        maintainer.clocks = Clock()  # a new process: no reading of the filesystem's clock yet
        report = run_pass(maintainer, BUDGET, timer=stopped_clock)
    assert report.entries_expired == 0, report
    assert [c for c in range(2) if _hit(store, c)] == [0, 1]


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


# ----------------------------------------------------------------------------- the rules, through the seam
#
# ``Clock`` is the seam: a reader and a maintainer are given their own (another boot id,
# a boot clock moved on, a wall clock off) against real pin files and real mtimes.

OTHER_BOOT = "0b0e1d00-0000-4000-8000-000000000001"
LEASE = 300.0


class Moving:
    """A boot clock this process's own, moved on by ``offset`` seconds."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(self) -> float:
        return SYSTEM_CLOCK.boot() + self.offset


def _same_boot(offset: float = 0.0, wall: float = 0.0) -> Clock:
    """Another process of this boot (its own sightings), its boot clock ``offset`` on."""
    if SYSTEM_CLOCK.boot_id is None:
        pytest.skip("no boot id on this kernel")
    return Clock(wall=lambda: REAL_TIME() + wall, boot=Moving(offset), boot_id=SYSTEM_CLOCK.boot_id)


def _other_boot(boot_at: float = 12.0) -> Clock:
    """A process on another host (or before a reboot): its own boot id and boot clock."""
    return Clock(boot=lambda: boot_at, boot_id=OTHER_BOOT)


def _reader_pins(tmp_path, clocks: Clock, **kw):
    """11 entries over max; the least recently used one leased by a reader with ``clocks``."""
    store = _store(tmp_path, **kw)
    paths = _fill(store, range(11))
    store.clocks = clocks
    lease = store.lookup(IDENT, conv_keys(0, 16), lease=True)
    del store.clocks  # the class's again: this process's real clocks
    assert lease.lease_id
    for conv in range(11):
        _shift_mtime(paths[conv], -(100 - conv) - (1000 if conv == 0 else 0))
    pin = os.path.join(store.layout.pins_dir, lease.lease_id + ".pin")
    return store, pin


def _pass(store, clocks: Clock):
    return run_pass(store, BUDGET, clocks=clocks, timer=stopped_clock)


def _protected(store, pin, report) -> bool:
    kept = os.path.exists(pin)
    assert kept == (report.pinned_skipped == 1), report
    return kept and store.entry(os.path.basename(pin)[:40]) is not None


@pytest.mark.parametrize("wall", [0.0, -HOUR, YEARS_10], ids=["wall_ok", "wall_1h_behind",
                                                            "wall_10y_ahead"])
def test_a_pin_of_this_boot_lasts_its_lease_on_the_boot_clock(tmp_path, wall):
    """Reader and maintainer of one boot, either wall clock anywhere: the lease ends when
    the boot clock says so (not before, not later)."""
    store, pin = _reader_pins(tmp_path, _same_boot(wall=wall))
    assert _protected(store, pin, _pass(store, _same_boot(LEASE - 5, wall=-wall)))
    assert not _protected(store, pin, _pass(store, _same_boot(LEASE + 5, wall=-wall)))
    assert not os.path.exists(pin)


def test_a_pin_of_this_boot_never_asks_for_more_than_the_maintainers_lease(tmp_path):
    store, pin = _reader_pins(tmp_path, _same_boot(), lease_seconds=1e9)
    store.lease_seconds = LEASE
    assert not _protected(store, pin, _pass(store, _same_boot(LEASE + 5)))


def test_a_pin_from_another_boot_is_aged_by_its_mtime_then_by_the_maintainers_boot_clock(tmp_path):
    store, pin = _reader_pins(tmp_path, _other_boot())
    maintainer = _same_boot()
    assert _protected(store, pin, _pass(store, maintainer))  # first seen: age ~0 by the mtime
    _shift_mtime(pin, -YEARS_10)  # the filesystem's clock stepped forward 10 years since
    assert _protected(store, pin, _pass(store, maintainer))  # aged by observation now
    maintainer._boot.offset = LEASE - 5
    assert _protected(store, pin, _pass(store, maintainer))
    maintainer._boot.offset = LEASE + 5
    assert not _protected(store, pin, _pass(store, maintainer))


def test_a_pin_from_another_boot_already_past_its_lease_protects_nothing(tmp_path):
    store, pin = _reader_pins(tmp_path, _other_boot())
    _shift_mtime(pin, -(LEASE + 5))  # a reader on another host that died 5 min ago
    assert not _protected(store, pin, _pass(store, _same_boot()))


@pytest.mark.parametrize("ahead", [HOUR, YEARS_10], ids=["1h", "10y"])
def test_a_pin_that_looks_written_in_the_future_protects_one_lease_from_its_first_sighting(
        tmp_path, ahead):
    """The filesystem's clock stepped back by ``ahead`` after a reader on another host
    pinned (or the mtime is forged): never zero, never forever."""
    store, pin = _reader_pins(tmp_path, _other_boot())
    _shift_mtime(pin, ahead)
    maintainer = _same_boot()
    assert _protected(store, pin, _pass(store, maintainer))
    maintainer._boot.offset = LEASE - 5
    assert _protected(store, pin, _pass(store, maintainer))
    maintainer._boot.offset = LEASE + 5
    assert not _protected(store, pin, _pass(store, maintainer))


def test_a_pin_of_this_boot_from_the_boot_clocks_future_is_forged_and_lasts_one_lease(tmp_path):
    store, pin = _reader_pins(tmp_path, _same_boot(offset=YEARS_10))
    maintainer = _same_boot()
    assert _protected(store, pin, _pass(store, maintainer))
    maintainer._boot.offset = LEASE + 5
    assert not _protected(store, pin, _pass(store, maintainer))


@pytest.mark.parametrize("recorded", ["1.0", "1e18", "{now}"])
def test_an_old_format_pin_lasts_the_lease_from_its_mtime(tmp_path, recorded):
    """A pin of the one-number format (its writer's Unix expiry, written during a rolling
    upgrade): its number is not trusted (any finite one reads), its age is its mtime's."""
    store = _store(tmp_path)
    paths = _fill(store, range(11))
    for conv in range(11):
        _shift_mtime(paths[conv], -(100 - conv))
    entry = store.entry(os.path.basename(paths[0])[:-3])
    pin = os.path.join(store.layout.pins_dir, f"{entry.entry_id}.{'ab' * 8}.pin")
    with open(pin, "w") as f:
        f.write(recorded.format(now=REAL_TIME() + LEASE) + "\n")
    assert verify_store(store.layout).ok
    maintainer = _same_boot()
    assert _protected(store, pin, _pass(store, maintainer))
    maintainer._boot.offset = LEASE + 5
    assert not _protected(store, pin, _pass(store, maintainer))


@pytest.mark.parametrize("text", ["v2 boot=- at=1 lease=nan\n", "v2 boot=- at=inf lease=1\n",
                                  "v2 boot=- at=-1 lease=1\n", "v2 boot=x at=1 lease=1\n",
                                  "v2 boot=- at=1 lease=1 more\n", "nan\n"])
def test_an_unreadable_pin_protects_nothing_and_verify_names_it(tmp_path, text):
    store = _store(tmp_path)
    paths = _fill(store, range(11))
    entry_id = os.path.basename(paths[0])[:-3]
    pin = os.path.join(store.layout.pins_dir, f"{entry_id}.{'cd' * 8}.pin")
    with open(pin, "w") as f:
        f.write(text)
    assert [p.kind for p in verify_store(store.layout).problems] == ["corrupt_pin"]
    assert not _protected(store, pin, _pass(store, _same_boot()))


def test_a_crashed_writers_temp_pin_goes_once_off_the_filesystems_now_either_way(tmp_path):
    store = _store(tmp_path)
    temps = {}
    for n, (label, shift) in enumerate((("fresh", 0.0), ("old", -HOUR), ("ahead", HOUR))):
        temps[label] = os.path.join(store.layout.pins_dir, f"{'e' * 40}.{str(n) * 16}.pin.tmp")
        open(temps[label], "w").close()
        _shift_mtime(temps[label], shift)
    _pass(store, _same_boot(wall=YEARS_10))
    assert {k: os.path.exists(p) for k, p in temps.items()} == {
        "fresh": True, "old": False, "ahead": False}


@pytest.mark.parametrize("offset", [-HOUR, YEARS_10], ids=["1h_behind", "10y_ahead"])
def test_pass_due_asks_for_ttl_on_the_filesystems_clock(tmp_path, offset):
    store = _store(tmp_path, ttl_seconds=60, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    paths = _fill(store, range(2))
    maintainer = _same_boot(wall=offset)
    assert not pass_due(store, maintainer)
    _shift_mtime(paths[1], -120)
    store.catalog.refresh_recency()  # as a pass re-reads it
    assert pass_due(store, maintainer)
