"""Property: whatever the clocks do, a live lease is never evicted, no pin protects for longer
than the rules allow, and no entry escapes the TTL (``sparkcache/store/clocks.py``).

Two hosts share one store: host 1 runs reader A and maintainer M (one boot: one boot id and
one boot clock), host 2 runs reader B and maintainer M2 (another boot). Each process has its
own ``Clock`` (its own sightings of pins) and its own ``PageStore`` on the root. The model
keeps true time ``t``; the actions:

* time passes by ``d``: both boot clocks move on ``d`` and every file's mtime moves back
  ``d`` (the filesystem's clock moved on ``d`` against what was stamped before);
* the filesystem's clock steps by ``s`` (every mtime moves back ``s``; true time stands);
* a reader publishes, takes a lease (publishes, then looks up with a lease: an access) or
  releases one;
* a maintainer runs a pass, with capacity pressure (it evicts every unpinned entry) or
  without (the TTL, 60 s, alone evicts).
Each reader's and maintainer's action runs with its wall clock off by a drawn step (2
minutes, an hour or 10 years either way; ``time.time`` patched): it must decide nothing.

After each pass by maintainer X at true time ``t``, with ``MARGIN`` for the seconds the run
itself takes and the slack of "stamped in the future" (``clocks.FUTURE_SLACK_S``):
* safety: a lease taken less than ``LEASE - MARGIN`` ago and not released keeps its pin and
  its entry; excused only for the documented window, a pin from X's other host that X had
  not yet seen when the filesystem's clock stepped forward;
* bound: a pin of X's host is gone once ``LEASE + MARGIN`` old; a pin of the other host once
  ``LEASE + MARGIN`` after X first saw it;
* TTL (no pressure): an entry without a pin, last accessed (or, after a backward step of the
  filesystem's clock, first re-stamped) over ``TTL + MARGIN`` ago, is gone.

``CLOCK_EXAMPLES`` (default 100) and ``CLOCK_STEPS`` (default 30) size the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from sparkcache.store import PassBudget, run_pass
from sparkcache.store.clocks import SYSTEM_CLOCK, Clock
from clock_helpers import FS_STEPS, TIME_STEPS, WALLS, as_wall, shift_mtimes
from store_helpers import IDENT, conv_keys, conv_pages, open_store, stopped_clock

EXAMPLES = int(os.environ.get("CLOCK_EXAMPLES", "100"))
STEPS = int(os.environ.get("CLOCK_STEPS", "30"))
LEASE, TTL, MARGIN = 100.0, 60.0, 7.0
OTHER_BOOT = "0b0e1d00-0000-4000-8000-000000000002"
CONVS = range(3)
BUDGET = PassBudget(max_entries=1024, max_bytes=1 << 50, max_ms=5000.0)


if SYSTEM_CLOCK.boot_id is None:
    pytest.skip("no boot id on this kernel (host 1's readers and maintainer share one)",
                allow_module_level=True)


class _Lease:
    def __init__(self, lease_id: str, conv: int, host: int, taken: float) -> None:
        self.lease_id, self.conv, self.host, self.taken = lease_id, conv, host, taken
        self.released = False
        self.excused = False  # the documented window (module docstring)
        self.seen: dict[str, float] = {}  # maintainer -> true time of its first sighting


class ClockSteps(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.work = tempfile.mkdtemp(prefix="clock-steps-")
        self.root = os.path.join(self.work, "store")
        self.t = 0.0
        start = SYSTEM_CLOCK.boot()
        host1 = lambda: SYSTEM_CLOCK.boot() + self.t  # noqa: E731
        host2 = lambda: SYSTEM_CLOCK.boot() - start + 50.0 + self.t  # noqa: E731
        boots = {1: (host1, SYSTEM_CLOCK.boot_id), 2: (host2, OTHER_BOOT)}
        self.host = {"A": 1, "M": 1, "B": 2, "M2": 2}
        self.stores = {}
        for name, host in self.host.items():
            store = open_store(self.root, page_blocks=4, lease_seconds=LEASE, ttl_seconds=TTL)
            store.clocks = Clock(boot=boots[host][0], boot_id=boots[host][1])
            self.stores[name] = store
        self.entry = {}  # conv -> entry id
        self.access = {}  # conv -> true time of its last access
        self.restamp_floor = -1e18  # true time of the first pass after a backward fs step
        self.restamp_due = False
        self.leases: list[_Lease] = []

    def teardown(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def _pin_path(self, lease: _Lease) -> str:
        return os.path.join(self.stores["M"].layout.pins_dir, lease.lease_id + ".pin")

    def _manifest(self, conv: int) -> str:
        return self.stores["M"].layout.manifest_path(IDENT.digest(), self.entry[conv])

    # ------------------------------------------------------------------ clocks

    @rule(d=TIME_STEPS)
    def time_passes(self, d):
        self.t += d
        shift_mtimes(self.root, d)

    @rule(s=FS_STEPS)
    def filesystem_clock_steps(self, s):
        shift_mtimes(self.root, s)
        if s > 0:  # forward: a pin from the other host not yet seen looks old at its sighting
            for lease in self.leases:
                for m in ("M", "M2"):
                    if self.host[m] != lease.host and m not in lease.seen:
                        lease.excused = True
        else:
            self.restamp_due = True

    # ------------------------------------------------------------------ readers

    @initialize(reader=st.sampled_from(["A", "B"]))
    def published(self, reader):
        for conv in CONVS:
            self.publish(reader, conv)

    @rule(reader=st.sampled_from(["A", "B"]), conv=st.sampled_from(CONVS), wall=WALLS)
    def publish(self, reader, conv, wall=0.0):
        with as_wall(wall):
            result = self.stores[reader].publish(IDENT, conv_keys(conv, 8), conv_pages(conv, 8, 4))
        assert result.ok, result
        self.entry[conv] = result.entry_id
        self.access[conv] = self.t  # a re-publication may not touch: a looser bound

    @rule(reader=st.sampled_from(["A", "B"]), conv=st.sampled_from(CONVS), wall=WALLS)
    def take_lease(self, reader, conv, wall):
        """A reader's capture published, then read under a lease (as a restore is)."""
        self.publish(reader, conv, wall)
        with as_wall(wall):
            result = self.stores[reader].lookup(IDENT, conv_keys(conv, 8), lease=True)
            self.stores[reader].accesses.flush()  # the hit is stamped off the lookup's thread
        assert result.hit and result.lease_id, result
        self.access[conv] = self.t
        self.leases.append(_Lease(result.lease_id, conv, self.host[reader], self.t))

    @precondition(lambda self: any(not x.released for x in self.leases))
    @rule(data=st.data())
    def release(self, data):
        lease = data.draw(st.sampled_from([x for x in self.leases if not x.released]))
        self.stores["A" if lease.host == 1 else "B"].release(lease.lease_id)
        lease.released = True

    # ------------------------------------------------------------------ maintainers

    @rule(maintainer=st.sampled_from(["M", "M2"]), pressure=st.booleans(), wall=WALLS)
    def maintenance_pass(self, maintainer, pressure, wall):
        """With ``pressure`` the store is over its cap: the pass evicts every unpinned
        entry; without, only what the TTL expired."""
        before = {x.lease_id for x in self.leases if os.path.exists(self._pin_path(x))}
        store = self.stores[maintainer]
        store.max_bytes, store.low_watermark_bytes = (1, 0) if pressure else (1 << 40, 1 << 39)
        with as_wall(wall):
            report = run_pass(store, BUDGET, sweep_shards=0, timer=stopped_clock)
        assert report.stopped_by == "done", report
        if self.restamp_due:
            self.restamp_floor, self.restamp_due = self.t, False
        problems = []
        for lease in self.leases:
            pinned = os.path.exists(self._pin_path(lease))
            age = self.t - lease.taken
            if not lease.released and age < LEASE - MARGIN and not lease.excused:
                if not pinned or not os.path.exists(self._manifest(lease.conv)):
                    problems.append(f"live lease lost: {vars(lease)} t={self.t} {report}")
            if self.host[maintainer] == lease.host:
                bound = lease.taken + LEASE
            else:
                bound = lease.seen.get(maintainer, float("inf")) + LEASE
            if pinned and self.t > bound + MARGIN:
                problems.append(f"pin outlived its bound {bound}: {vars(lease)} t={self.t}")
            if lease.lease_id in before:
                lease.seen.setdefault(maintainer, self.t)
        if not pressure:
            with_pins = {x.conv for x in self.leases if os.path.exists(self._pin_path(x))}
            for conv in self.entry:
                last = max(self.access[conv], self.restamp_floor)
                if (conv not in with_pins and self.t > last + TTL + MARGIN
                        and os.path.exists(self._manifest(conv))):
                    problems.append(f"conv {conv} escaped the TTL: last {last}, t={self.t}")
        assert not problems, "\n".join(problems)


ClockSteps.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS,
                                        deadline=None, database=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_clock_steps_never_lose_a_lease_nor_pin_forever = ClockSteps.TestCase
