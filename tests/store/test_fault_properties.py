"""Property: on a filesystem that fails on demand while clocks step, the store loses nothing
it holds, never returns wrong bytes, never raises, never hangs, never evicts a live lease,
and once the faults are gone its store verifies clean.

A new module rather than an extension of ``test_hostile_properties.py`` (damage to files
on a plain directory, one battery of operations per example) or ``test_clock_properties.py``
(two hosts, no faults): here the store lives on ``tests/faultfs.py`` (FUSE) and the faults
come and go *between* the store's calls, so this is a state machine over one store and two
processes' views of it, with the clock machinery of ``clock_helpers.py``.

The store: three conversations, each publishable at 4, 6 or 8 blocks (4 blocks per page,
256 bytes per block: one or two pages of 512 B to 1 KiB), lease 100 s, TTL 60 s. Two
``PageStore``s on the mount, as two processes of one host (one boot id, one boot clock
that true time moves; each with its own ``Clock``): the reader R (publishes, looks up,
leases, reads) and the maintainer M (passes). The actions:

* R publishes a conversation at a drawn length (a longer one supersedes its shorter
  entries), looks it up plain, with a lease or verified, reads what it hit, fetches
  (lookup, read, release), releases a lease;
* M runs a pass, with capacity pressure (every unpinned entry goes) or without (the TTL
  alone evicts), with or without a full orphan sweep (256 shards);
* a new writer's open (recovery) replaces R or M; ``verify_store``;
* a publication of another process is live (its intent locked, its declared object on disk
  and named by no manifest) or ends;
* **I/O errors**: each of the actions above first arms a drawn fault, or none: EIO or
  EACCES at a drawn path class (the namespace, manifests/, an identity directory, a
  manifest, objects/, a shard, an object, pins/, a pin, staging/, a staging file, locks/,
  the lock file, a file removed while open) on a drawn operation the kernel asks there (of
  a directory: getattr, opendir, readdir, mkdir, fsyncdir, utimens; of a file: getattr,
  open, create, read, write, flush (its close), fsync, rename, unlink, utimens), after 0-2
  matching calls, once or from then on; armed faults stay until all are cleared, which
  may happen once the last has stood for ``STEPS_ARMED`` steps. (Armed with the action
  rather than by rules of their own, faults meet the calls they strike far more often:
  with the fix for a failed manifest unlink reverted, 800 examples of the earlier design
  passed; this one fails on it);
* **clock steps**: true time passes (1 s to 250 s: both boot clocks move on), the
  filesystem's clock steps (2 min, 1 h, 10 years either way), and every action of R or M
  runs with its wall clock (``time.time``) off the filesystem's by a drawn step. A step of
  the filesystem's clock moves every backing mtime back by the step, as
  ``test_clock_properties`` does, *and* moves the clock FaultFS reports by it
  (``FaultFS.set_clock``): files stamped before keep their times, files stamped after (a
  write, an access, the pins directory the store stamps to learn the filesystem's now) get
  the new clock's. Moving the mtimes alone leaves the filesystem's "now" behind, which a
  store that could not probe it (a fault at the pins directory) and advances its last
  reading by its boot clock would see off by every step taken meanwhile: an artefact.

The model, decided from the backing disk and what the store returned: the entries known as
published (a publication that returned ok), the leases taken (a hit under a lease; one whose
release left its pin file is still held), the live publication. An entry leaves the model
only when it is gone from disk after an action entitled to remove it: a pass under pressure
(an entry without a live lease), a pass without pressure (an entry without a live lease
whose manifest's backing mtime is over the TTL old when the pass ends), a publication of a
longer prefix of its conversation (supersession, without a live lease). That is what the
same action removes on the healthy filesystem, whether or not a fault is armed: "evicted
only by a pass with no active fault" would call a right eviction under a fault elsewhere
(an object's unlink, a pin's read) a loss; a fault must only never remove what the
healthy run keeps (``test_faults.py``'s ``removed(fault) <= removed(clean)``). A lease is
live while it is held and younger than the lease on the boot clock (5 s of margin either
side for the step's own run).

Checked after every step (and at the end of each example, with the faults cleared):
  1. nothing is lost on a transient error: every entry in the model has its manifest and
     every object on the backing disk; whenever no fault is armed, a lookup of it by R hits
     all its blocks and its read is byte-identical (checked when the faults are cleared,
     and at every lookup while none is armed);
  2. never wrong bytes: every read that returns bytes returns what was published for the
     entry that the hit names;
  3. no public call raises or runs past ``FAULT_HANG_S`` (``hostile_helpers.bounded``);
     misses, failed publications and stopped passes are answers. Two calls refuse by
     raising ``OSError``, by design, and may while a fault is armed: a writer's open
     (``PageStore``) and ``verify_store`` (the CLI turns it into its error exit);
  4. a live lease keeps its pin file and its entry, whatever the clocks;
  5. with the faults cleared, ``verify_store`` reports no problem (only faults, no damage);
  6. with no fault armed, a pass ends ``done``: no fault leaves the store unable to evict.

``FAULT_EXAMPLES`` (default 60), ``FAULT_STEPS`` (default 25) and ``FAULT_HANG_S`` (default
30) size the run; a search: ``FAULT_EXAMPLES=2000 pytest tests/store/test_fault_properties.py``.
Needs root (FUSE).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from sparkcache.store import PageStore, PassBudget, ReadResult, run_pass, verify_store
from sparkcache.store.clocks import SYSTEM_CLOCK, Clock
from sparkcache.store.identity import entry_id_for
from sparkcache.store.objects import digest_of
from sparkcache.store.staging import Staging

from clock_helpers import FS_STEPS, REAL_TIME, TIME_STEPS, WALLS, YEARS_10, as_wall, shift_mtimes
from faultfs import FaultFS
from hostile_helpers import Hung, bounded
from store_helpers import IDENT, conv_keys, conv_pages, stopped_clock

pytestmark = pytest.mark.root  # FUSE mounts need root

EXAMPLES = int(os.environ.get("FAULT_EXAMPLES", "60"))
STEPS = int(os.environ.get("FAULT_STEPS", "25"))
HANG_S = float(os.environ.get("FAULT_HANG_S", "30"))
LEASE, TTL = 100.0, 60.0
LEASE_MARGIN = 5.0  # boot-clock seconds: a lease this close to its end may go either way
BPP = 4
CONVS = (1, 2, 3)
LENGTHS = (4, 6, 8)
BUDGET = PassBudget(max_entries=1024, max_bytes=1 << 50, max_ms=5000.0)
STEPS_ARMED = 3  # a fault stays armed for at least this many steps
MAX_FS_OFFSET = 3 * YEARS_10  # the filesystem's clock stays within 30 years of the kernel's
LIVE_BYTES = b"a live publication's object" * 32

# Where a fault strikes: a path class and the operations the kernel asks there (a name is
# looked up with getattr on the way to anything below it).
DIR_OPS = ("getattr", "opendir", "readdir", "mkdir", "fsyncdir", "utimens")
FILE_OPS = ("getattr", "open", "create", "read", "write", "flush", "fsync", "rename", "unlink",
            "utimens")
WHERE = {
    "namespace": (r"^/default$", DIR_OPS),
    "manifests/": (r"^/default/manifests$", DIR_OPS),
    "identity dir": (r"^/default/manifests/[0-9a-f]{32}$", DIR_OPS),
    "manifest": (r"^/default/manifests/[0-9a-f]{32}/[0-9a-f]{40}\.mf$", FILE_OPS),
    "objects/": (r"^/default/objects$", DIR_OPS),
    "shard": (r"^/default/objects/[0-9a-f]{2}$", DIR_OPS),
    "object": (r"^/default/objects/[0-9a-f]{2}/[0-9a-f]{62}$", FILE_OPS),
    "pins/": (r"^/default/pins$", DIR_OPS),
    "pin": (r"^/default/pins/[^/]+$", FILE_OPS),
    "staging/": (r"^/default/staging$", DIR_OPS),
    "staging file": (r"^/default/staging/[^/]+$", FILE_OPS),
    "locks/": (r"^/default/locks$", DIR_OPS),
    "gc.lock": (r"^/default/locks/gc\.lock$", FILE_OPS),
    # a file reached through a descriptor after its name was removed (an intent's last
    # close, a manifest unlinked under a reader): FaultFS sees no path
    "removed while open": (r"^$", ("getattr", "read", "write", "flush", "fsync")),
}
ERRNOS = {"EIO": errno.EIO, "EACCES": errno.EACCES}


@dataclass(frozen=True)
class Fault:
    """``err`` on the ``op`` of a path of class ``where``, after ``after`` such calls,
    ``times`` times (-1: from then on)."""

    where: str
    op: str
    err: str
    times: int
    after: int


# the class first, then one of its operations (one draw among ~90 pairs covers them unevenly)
FAULTS = st.sampled_from(sorted(WHERE)).flatmap(lambda where: st.builds(
    Fault, st.just(where), st.sampled_from(WHERE[where][1]), st.sampled_from(sorted(ERRNOS)),
    st.sampled_from([1, -1]), st.integers(0, 2)))
# what each action of the store arms first: a fault (kept until cleared), or none
ARM = st.none() | FAULTS


@dataclass(frozen=True)
class Published:
    """What one publication of conversation ``conv`` at ``n`` blocks puts on disk."""

    conv: int
    n: int
    entry_id: str
    pages: tuple[bytes, ...]
    manifest: str  # relative to the namespace directory
    objects: tuple[tuple[str, int], ...]  # (relative path, size)


def _published(conv: int, n: int) -> Published:
    idd = IDENT.digest()
    keys = conv_keys(conv, n)
    pages = tuple(conv_pages(conv, n, BPP))
    entry_id = entry_id_for(idd, keys[-1])
    objects = tuple((f"objects/{d[:2]}/{d[2:]}", len(p)) for p, d in
                    ((p, digest_of(p)) for p in pages))
    return Published(conv, n, entry_id, pages, f"manifests/{idd}/{entry_id}.mf", objects)


ENTRIES = {(c, n): _published(c, n) for c in CONVS for n in LENGTHS}
BY_ID = {p.entry_id: p for p in ENTRIES.values()}


def _event(text: str) -> None:
    """Count ``text`` in hypothesis's statistics (nothing when a test drives the machine)."""
    try:
        event(text)
    except InvalidArgument:
        pass


class _Lease:
    def __init__(self, lease_id: str, entry_id: str, taken: float) -> None:
        self.lease_id, self.entry_id, self.taken = lease_id, entry_id, taken
        self.released = False

    def __repr__(self) -> str:
        p = BY_ID[self.entry_id]
        return f"lease({self.lease_id[:8]}.., conv {p.conv}/{p.n}, taken at {self.taken:.0f})"


class FaultsAndClocks(RuleBasedStateMachine):
    def __init__(self, fs: FaultFS) -> None:
        super().__init__()
        self.fs = fs
        fs.clear()
        fs.set_clock(0.0)
        shutil.rmtree(fs.backing / "default", ignore_errors=True)
        self.base = fs.backing / "default"
        self.t = 0.0  # true time the test moved on (both boot clocks carry it)
        self.fs_offset = 0.0  # the filesystem's clock from the kernel's
        self.armed: list[Fault] = []  # since the last clear
        self.steps_armed = 0  # steps since the last fault was armed
        self.live: set[tuple[int, int]] = set()  # entries known as published and kept
        self.leases: list[_Lease] = []
        self.live_pub: tuple[Staging, str] | None = None  # (its staging, its object's path)
        self.stores = {"R": self._open(), "M": self._open()}

    # ------------------------------------------------------------------ plumbing

    def _boot(self) -> float:
        return SYSTEM_CLOCK.boot() + self.t

    def _open(self) -> PageStore:
        store = PageStore(str(self.fs.mount), page_blocks=BPP, lease_seconds=LEASE,
                          ttl_seconds=TTL, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
        store.clocks = Clock(boot=self._boot, boot_id=SYSTEM_CLOCK.boot_id)
        return store

    def _call(self, what: str, fn, wall: float = 0.0):
        """``fn()`` with this process's wall clock ``wall`` off the filesystem's, bounded."""
        fired = self.fs.fired() if self.armed else 0
        try:
            with bounded(HANG_S), as_wall(self.fs_offset + wall):
                return fn()
        except Hung:
            raise AssertionError(f"{what}: still running after {HANG_S:g} s") from None
        finally:
            if self.armed and self.fs.fired() > fired:
                _event(f"a fault fired in: {what.split(' ')[0]}")

    def _exists(self, rel: str, size: int | None = None) -> bool:
        try:
            st_ = os.lstat(self.base / rel)
        except FileNotFoundError:
            return False
        return size is None or st_.st_size == size

    def _pin(self, lease: _Lease) -> str:
        return f"pins/{lease.lease_id}.pin"

    def _held(self) -> list[_Lease]:
        """Leases held (never released, or released while their pin file stayed)."""
        for lease in self.leases:
            if not lease.released and not self._exists(self._pin(lease)):
                lease.released = True  # gone: released, or (checked elsewhere) taken away
        return [x for x in self.leases if not x.released]

    def _live_leases(self) -> list[_Lease]:
        now = self._boot()
        return [x for x in self._held() if now - x.taken < LEASE - LEASE_MARGIN]

    def _protected(self) -> set[str]:
        return {x.entry_id for x in self._live_leases()}

    def _losses(self, key: tuple[int, int]) -> list[str]:
        p = ENTRIES[key]
        out = [] if self._exists(p.manifest) else [p.manifest]
        return out + [rel for rel, size in p.objects if not self._exists(rel, size)]

    def _settle(self, what: str, entitled: set[tuple[int, int]] = frozenset()) -> None:
        """After ``what``: an entry it was entitled to remove and whose manifest is gone
        leaves the model; any other loss fails."""
        problems = []
        for key in sorted(self.live):
            lost = self._losses(key)
            if not lost:
                continue
            if key in entitled and ENTRIES[key].manifest in lost:
                self.live.discard(key)
                _event(f"an entry left the model: {what.split(' ')[0]}")
                continue
            why = "entitled, but its manifest stayed" if key in entitled else "not entitled"
            problems.append(f"{what} lost conv {key[0]}/{key[1]} ({why}): {lost}")
        assert not problems, "\n".join(problems)

    def _no_fault(self) -> bool:
        return not self.armed

    def _check_read(self, what: str, store: PageStore, result, n: int) -> ReadResult:
        """A hit's read returns exactly the bytes of the entry the hit names."""
        assert result.hit_blocks <= n, f"{what}: {result.hit_blocks} blocks hit of {n} looked up"
        p = BY_ID.get(result.entry_id)
        assert p is not None, f"{what}: a hit on an entry never published: {result}"
        read = self._call(f"{what}: read", lambda: store.read(result.handle, result.hit_blocks))
        assert read.ok or (read.reason and read.reason != "hit"), f"{what}: read {read}"
        if read.ok:
            got = [bytes(x) for x in read.pages]
            assert got == list(p.pages[:len(got)]), f"{what}: WRONG BYTES from {p.conv}/{p.n}"
        return read

    def _found(self, what: str, store: PageStore, key: tuple[int, int], result) -> None:
        """With no fault armed, the lookup ``result`` of an entry in the model hits all its
        blocks, and its read returns the entry's bytes."""
        conv, n = key
        assert result.hit and result.hit_blocks == n, \
            f"{what}: conv {conv}/{n}, on disk and in the model, does not hit: {result}"
        read = self._check_read(f"{what}: lookup {conv}/{n}", store, result, n)
        assert read.ok, f"{what}: conv {conv}/{n} hits but does not read: {read}"

    def _all_back(self, what: str) -> None:
        """With no fault armed: every entry of the model hits all its blocks and reads
        back; ``verify_store`` finds nothing."""
        store = self.stores["R"]
        for key in sorted(self.live):
            conv, n = key
            result = self._call(f"{what}: lookup {conv}/{n}",
                                lambda: store.lookup(IDENT, conv_keys(conv, n)))
            self._found(what, store, key, result)
        report = self._call(f"{what}: verify_store", lambda: verify_store(store.layout))
        assert not report.problems, f"{what}: verify_store after faults only: {report.problems}"

    # ------------------------------------------------------------------ invariants

    @invariant()
    def disk_holds_the_model(self):
        self.steps_armed += 1  # (runs after every step: the machine's step count)
        self._settle("(between steps)")
        taken = [x for x in self._live_leases() if not self._exists(self._pin(x))]
        assert not taken, f"live leases lost their pins: {taken}"
        if self.live_pub is not None:
            assert self._exists(self.live_pub[1]), "a live publication's declared object is gone"

    # ------------------------------------------------------------------ the reader

    @initialize(lengths=st.lists(st.sampled_from(LENGTHS), min_size=len(CONVS),
                                 max_size=len(CONVS)))
    def published(self, lengths):
        for conv, n in zip(CONVS, lengths):
            self.publish(conv, n, 0.0)
            assert (conv, n) in self.live, "a publication on the healthy filesystem failed"

    @rule(conv=st.sampled_from(CONVS), n=st.sampled_from(LENGTHS), wall=WALLS, fault=ARM)
    def publish(self, conv, n, wall, fault=None):
        self._arm(fault)
        protected = self._protected()
        store = self.stores["R"]
        result = self._call(f"publish {conv}/{n}", lambda: store.publish(
            IDENT, conv_keys(conv, n), list(ENTRIES[conv, n].pages)), wall)
        entitled = set()
        if result.ok:
            assert result.entry_id == ENTRIES[conv, n].entry_id, result
            self.live.add((conv, n))
            entitled = {(conv, m) for m in LENGTHS
                        if m < n and ENTRIES[conv, m].entry_id not in protected}
        else:
            assert result.reason and result.detail, f"a failed publication says nothing: {result}"
            assert not self._no_fault(), f"a publication failed with no fault armed: {result}"
        self._settle(f"publish {conv}/{n}", entitled)

    @rule(conv=st.sampled_from(CONVS), n=st.sampled_from(LENGTHS),
          how=st.sampled_from(["plain", "lease", "verify"]), wall=WALLS, fault=ARM)
    def lookup(self, conv, n, how, wall, fault):
        self._arm(fault)
        store = self.stores["R"]
        taken = self._boot()
        result = self._call(f"lookup({how}) {conv}/{n}", lambda: store.lookup(
            IDENT, conv_keys(conv, n), lease=how == "lease", verify=how == "verify"), wall)
        if result.hit:
            if result.lease_id:
                self.leases.append(_Lease(result.lease_id, result.entry_id, taken))
            self._check_read(f"lookup({how}) {conv}/{n}", store, result, n)
        else:
            assert result.reason and result.reason != "hit", result
        if self._no_fault() and (conv, n) in self.live:
            self._found(f"lookup({how}), no fault armed", store, (conv, n), result)
        self._settle(f"lookup {conv}/{n}")

    @rule(conv=st.sampled_from(CONVS), n=st.sampled_from(LENGTHS), wall=WALLS, fault=ARM)
    def fetch(self, conv, n, wall, fault):
        self._arm(fault)
        store = self.stores["R"]
        taken = self._boot()
        result, read = self._call(f"fetch {conv}/{n}",
                                  lambda: store.fetch(IDENT, conv_keys(conv, n)), wall)
        if result.hit:
            p = BY_ID.get(result.entry_id)
            assert p is not None and result.hit_blocks <= n, result
            if result.lease_id:  # a release that failed leaves the pin: still held
                self.leases.append(_Lease(result.lease_id, result.entry_id, taken))
            if read.ok:
                got = [bytes(x) for x in read.pages]
                assert got == list(p.pages[:len(got)]), f"fetch {conv}/{n}: WRONG BYTES"
        self._settle(f"fetch {conv}/{n}")

    @rule(which=st.integers(0, 7), fault=ARM)
    def release(self, which, fault):
        """The ``which``-th lease held (modulo their number; none held: nothing). No draw
        or precondition of this machine depends on what the store did (a replay by
        hypothesis must draw the same, whatever the timing of the kernel and the store)."""
        self._arm(fault)
        held = self._held()
        if not held:
            return
        lease = held[which % len(held)]
        self._call("release", lambda: self.stores["R"].release(lease.lease_id))
        self._held()
        self._settle("release")

    # ------------------------------------------------------------------ the maintainer

    @rule(pressure=st.booleans(), sweep=st.booleans(), wall=WALLS, fault=ARM)
    def maintenance_pass(self, pressure, sweep, wall, fault):
        self._arm(fault)
        store = self.stores["M"]
        store.max_bytes, store.low_watermark_bytes = (1, 0) if pressure else (1 << 40, 1 << 39)
        protected = self._protected()
        candidates = {k for k in self.live if ENTRIES[k].entry_id not in protected}
        mtimes = {}
        for key in candidates:
            try:
                mtimes[key] = os.lstat(self.base / ENTRIES[key].manifest).st_mtime
            except FileNotFoundError:
                pass
        report = self._call("maintenance pass", lambda: run_pass(
            store, BUDGET, sweep_shards=256 if sweep else 0, timer=stopped_clock), wall)
        ended = REAL_TIME()
        if pressure:
            entitled = candidates
        else:  # what a pass on the healthy filesystem could have expired by its end
            entitled = {k for k, m in mtimes.items() if ended - m > TTL}
        _event(f"pass: {report.stopped_by}" + (", a fault armed" if self.armed else "")
               + (f", {len(protected & {ENTRIES[k].entry_id for k in self.live})} live lease(s)"
                  if protected else ""))
        self._settle(f"pass (pressure={pressure}) {report}", entitled)
        if self._no_fault():
            assert report.stopped_by == "done", f"a pass with no fault armed: {report}"

    @rule(which=st.sampled_from(["R", "M"]), wall=WALLS, fault=ARM)
    def new_writer(self, which, wall, fault):
        """A writer's open: recovery, and a fresh view (a new process, its own clock)."""
        self._arm(fault)
        try:
            store = self._call(f"open {which}", self._open, wall)
        except OSError:
            assert not self._no_fault(), "a writer's open failed with no fault armed"
        else:
            self.stores[which].close()  # the process it stands for is gone
            self.stores[which] = store
        self._settle(f"open {which}")

    @rule(wall=WALLS, fault=ARM)
    def verify(self, wall, fault):
        self._arm(fault)
        try:
            report = self._call("verify_store", lambda: verify_store(self.stores["M"].layout), wall)
        except OSError:
            assert not self._no_fault(), "verify_store raised with no fault armed"
        else:
            if self._no_fault():
                assert not report.problems, f"verify_store, no fault armed: {report.problems}"
        self._settle("verify_store")

    # ------------------------------------------------------------------ another publisher

    @rule(fault=ARM)
    def live_publication(self, fault):
        """Another process's publication starts (its intent locked, its object written, no
        manifest yet; opening the intent goes through the mount and may fail: none then),
        or the one live ends."""
        self._arm(fault)
        if self.live_pub is not None:
            self._end_live_publication()
            return
        staging = Staging(self.stores["R"].layout)
        try:
            with bounded(HANG_S):
                staging.open()
                digest = digest_of(LIVE_BYTES)
                staging.declare([digest])
        except OSError:
            try:
                staging.close()
            except OSError:
                pass
            return
        rel = f"objects/{digest[:2]}/{digest[2:]}"
        (self.base / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.base / rel).write_bytes(LIVE_BYTES)
        self.live_pub = (staging, rel)

    def _end_live_publication(self) -> None:
        staging, _ = self.live_pub
        self.live_pub = None
        try:
            with bounded(HANG_S):
                staging.close()
        except OSError:
            pass  # its intent may stay: unlocked, a dead publication's

    # ------------------------------------------------------------------ faults

    def _arm(self, fault: Fault | None) -> None:
        if fault is None:
            return
        self.fs.fail(fault.op, WHERE[fault.where][0], ERRNOS[fault.err], after=fault.after,
                     times=fault.times)
        self.armed.append(fault)
        self.steps_armed = 0

    @precondition(lambda self: self.armed and self.steps_armed >= STEPS_ARMED)
    @rule()
    def faults_cleared(self):
        self.fs.clear()
        self.armed.clear()
        self._all_back("faults cleared")
        self._settle("faults cleared")

    # ------------------------------------------------------------------ clocks

    def _filesystem_clock_moves(self, seconds: float) -> None:
        shift_mtimes(str(self.base), seconds)  # what was stamped keeps its time
        self.fs_offset += seconds  # what is stamped from now on gets the new clock's
        self.fs.set_clock(self.fs_offset)

    @rule(d=TIME_STEPS)
    def time_passes(self, d):
        self.t += d
        self._filesystem_clock_moves(d)

    @rule(s=FS_STEPS)
    def filesystem_clock_steps(self, s):
        if abs(self.fs_offset + s) <= MAX_FS_OFFSET:
            self._filesystem_clock_moves(s)

    # ------------------------------------------------------------------ the end

    def teardown(self) -> None:
        try:
            if self.live_pub is not None:
                self._end_live_publication()
            if sys.exc_info()[1] is None:  # a passing example ends with the faults cleared
                self.faults_cleared()
        finally:
            self.fs.clear()
            self.fs.set_clock(0.0)
            for store in self.stores.values():
                store.close()  # its writer's claim: the next example's files reuse these names
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def faultfs(tmp_path_factory):
    with FaultFS(tmp_path_factory.mktemp("fault-properties")) as mounted:
        yield mounted


def test_faults_and_clock_steps_lose_nothing(faultfs, caplog, capsys):
    # the reader's and the maintainer's leases compare on one boot clock (Linux always has it)
    assert SYSTEM_CLOCK.boot_id is not None, "no boot id on this kernel (/proc/sys/kernel/random/boot_id)"
    caplog.set_level(logging.ERROR, logger="sparkcache.store")  # a stopped pass warns: expected
    examples = []
    run_state_machine_as_test(
        lambda: examples.append(1) or FaultsAndClocks(faultfs),
        settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                          database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.data_too_large]))
    with capsys.disabled():  # the count a search reports (FAULT_EXAMPLES)
        print(f"\nfault state machine: {len(examples)} examples of up to {STEPS} steps, none failed")
