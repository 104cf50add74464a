"""``read_pages_into``: a page read straight into the caller's buffers (a restore's destination
blocks), in order, whatever their number and sizes (more than one ``preadv``'s iovec limit
included), hashed as it is read and verified against what its manifest records: XXH3-128, or
the BLAKE3 name of a page that records none. A wrong byte or size is refused; an object gone
before the read writes nothing into the buffers."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkcache.store import ObjectError, Reason
from sparkcache.store import cpus
from sparkcache.store.backend import digest_of
from sparkcache.store.cpus import held_to
from sparkcache.store.layout import parallel_map, pool_cpus
from store_helpers import IDENT, conv_keys, flip_bit, open_store

_DIR = tempfile.TemporaryDirectory(prefix="sc-read-into-")
_STORE = []


def _store():
    if not _STORE:
        _STORE.append(open_store(os.path.join(_DIR.name, "s"), page_blocks=1))
    return _STORE[0]


def _split(data: bytes, cuts: list[int]) -> list[memoryview]:
    bounds = [0, *sorted(set(c % (len(data) + 1) for c in cuts)), len(data)]
    return [memoryview(bytearray(hi - lo)) for lo, hi in zip(bounds, bounds[1:])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=1, max_size=3 << 20), cuts=st.lists(st.integers(0, 3 << 20), max_size=40),
       recorded=st.booleans())
def test_any_split_reads_the_page_and_verifies_it(data, cuts, recorded):
    store = _store()
    keys = conv_keys(abs(hash((data[:64], len(data)))) % 10**9, 1)
    result = store.publish(IDENT, keys, [data])
    assert result.ok, result
    ref = store.lookup(IDENT, keys).handle.pages[0]
    if not recorded:  # a manifest written before checksums: verified by the BLAKE3 name
        ref = dataclasses.replace(ref, checksum=None)
    views = _split(data, cuts)
    store.read_pages_into([ref], lambda i: views)
    assert b"".join(bytes(v) for v in views) == data


def test_more_buffers_than_one_preadv_takes(tmp_path):
    store = open_store(tmp_path / "s", page_blocks=1)
    data = os.urandom(5000 * 7)
    assert store.publish(IDENT, conv_keys(1, 1), [data]).ok
    ref = store.lookup(IDENT, conv_keys(1, 1)).handle.pages[0]
    views = [memoryview(bytearray(7)) for _ in range(5000)]  # past IOV_MAX (1,024 on Linux)
    store.read_pages_into([ref], lambda i: views)
    assert b"".join(bytes(v) for v in views) == data


@pytest.mark.parametrize("recorded", [True, False], ids=["xxh3", "blake3-name"])
def test_a_flipped_byte_is_refused(tmp_path, recorded):
    store = open_store(tmp_path / "s", page_blocks=1)
    data = os.urandom(1 << 20)
    assert store.publish(IDENT, conv_keys(1, 1), [data]).ok
    ref = store.lookup(IDENT, conv_keys(1, 1)).handle.pages[0]
    ref = ref if recorded else dataclasses.replace(ref, checksum=None)
    flip_bit(store.objects.path(ref.digest), 123_456)
    views = _split(data, [1000, 500_000])
    with pytest.raises(ObjectError) as err:
        store.read_pages_into([ref], lambda i: views)
    assert err.value.reason is Reason.CORRUPT


@pytest.mark.parametrize("bad", [[4], [1, 4], [5, 0]], ids=["one", "two", "first-and-last"])
def test_pages_read_on_parallel_threads_raise_the_first_bad_one(tmp_path, bad):
    """Runs of pages are read on one thread per CPU; every good page is still verified and
    the error raised is the first bad page's, in page order."""
    store = open_store(tmp_path / "s", page_blocks=1)
    pages = [os.urandom(300_000 + i) for i in range(6)]
    assert store.publish(IDENT, conv_keys(1, 6), pages).ok
    refs = store.lookup(IDENT, conv_keys(1, 6)).handle.pages
    views = [[memoryview(bytearray(len(p)))] for p in pages]
    store.read_pages_into(refs, lambda i: views[i])  # the control
    assert [bytes(v[0]) for v in views] == pages
    for i in bad:
        flip_bit(store.objects.path(refs[i].digest), 1234)
    with pytest.raises(ObjectError) as err:
        store.read_pages_into(refs, lambda i: views[i])
    assert err.value.reason is Reason.CORRUPT and err.value.digest == refs[min(bad)].digest


@pytest.mark.parametrize("gone", [0, 2, 5])
def test_an_object_gone_writes_nothing_and_sizes_must_add_up(tmp_path, gone):
    """Each reader checks its run of pages present, and none writes before all have: one
    object gone, wherever it is, leaves every buffer untouched."""
    store = open_store(tmp_path / "s", page_blocks=1)
    pages = [os.urandom(4096) for _ in range(6)]
    assert store.publish(IDENT, conv_keys(1, 6), pages).ok
    refs = store.lookup(IDENT, conv_keys(1, 6)).handle.pages
    os.unlink(store.objects.path(refs[gone].digest))
    views = [[memoryview(bytearray(4096))] for _ in pages]
    with pytest.raises(ObjectError) as err:
        store.read_pages_into(refs, lambda i: views[i])
    assert err.value.reason is Reason.ABSENT and err.value.digest == refs[gone].digest
    assert not any(any(bytes(v[0])) for v in views), "a page was read although another was gone"
    with pytest.raises(ValueError, match="views of 4095 bytes for an object of 4096"):
        store.read_pages_into([refs[gone - 1]], lambda i: [memoryview(bytearray(4095))])


def _link_elsewhere(path: str, elsewhere) -> None:
    """``path`` moved to ``elsewhere`` (the same bytes) and a symbolic link to it left in its place."""
    os.rename(path, elsewhere)
    os.symlink(elsewhere, path)


def _three_pages(first_and_last_in_one_shard: bool) -> list[bytes]:
    """Three random pages; the first and the last named into one shard directory, or into two."""
    while True:
        pages = [os.urandom(4096) for _ in range(3)]
        if (digest_of(pages[0])[:2] == digest_of(pages[2])[:2]) == first_and_last_in_one_shard:
            return pages


@pytest.mark.parametrize("one_shard", [False, True], ids=["shards-apart", "one-shard"])
@pytest.mark.parametrize("call", ["read_pages_into", "check_pages_present"])
@pytest.mark.parametrize("damage", ["object-link", "shard-link", "objects-dir-link", "objects-dir-gone"])
def test_a_restore_finds_its_objects_from_the_objects_directory_never_through_a_link(tmp_path, call, damage, one_shard):
    """A restore walks from the root to ``objects/`` once and finds each object from there:
    a link anywhere on the way (the object, its shard, ``objects/`` itself) is ``corrupt``,
    even to the very same bytes, and ``objects/`` gone is ``absent``; nothing is written."""
    store = open_store(tmp_path / "s", page_blocks=1)
    pages = _three_pages(one_shard)
    assert store.publish(IDENT, conv_keys(1, 3), pages).ok
    refs = store.lookup(IDENT, conv_keys(1, 3)).handle.pages
    last = store.objects.path(refs[-1].digest)
    damaged = {"object-link": last, "shard-link": os.path.dirname(last)}.get(damage, store.layout.objects_dir)
    # The first page refused is the first whose object lies under what was damaged.
    first_refused = next(r for r in refs if os.path.commonpath([store.objects.path(r.digest), damaged]) == damaged)
    if damage == "objects-dir-gone":
        os.rename(damaged, tmp_path / "moved")
    else:
        _link_elsewhere(damaged, tmp_path / "moved")
    views = [[memoryview(bytearray(4096))] for _ in pages]
    with pytest.raises(ObjectError) as err:
        if call == "read_pages_into":
            store.read_pages_into(refs, lambda i: views[i])
        else:
            store.check_pages_present(refs)
    assert err.value.reason is (Reason.ABSENT if damage == "objects-dir-gone" else Reason.CORRUPT)
    assert err.value.digest == first_refused.digest
    assert not any(any(bytes(v[0])) for v in views), "a page was written although an object was refused"


def _published(tmp_path, n: int) -> tuple:
    store = open_store(tmp_path / "s", page_blocks=1)
    pages = [os.urandom(65536) for _ in range(n)]
    assert store.publish(IDENT, conv_keys(1, n), pages).ok
    return store, pages, store.lookup(IDENT, conv_keys(1, n)).handle.pages


def test_each_reader_is_held_to_a_cpu_of_its_own(tmp_path):
    """Left to the kernel, the readers woken after an idle spell started on one CPU and shared
    it for the whole restore; each is held to its own, and given its CPUs back after."""
    where = pool_cpus("io")
    assert len(where) >= 2, f"this test needs 2 CPUs; the io pool runs on {where}"
    store, pages, refs = _published(tmp_path, 4 * len(where))
    seen: dict[int, tuple] = {}

    def views_of(i: int) -> list[memoryview]:
        seen[i] = (threading.get_ident(), frozenset(os.sched_getaffinity(0)))
        time.sleep(0.02)  # every reader is up before the pages run out
        return [memoryview(bytearray(len(pages[i])))]

    store.read_pages_into(refs, views_of)
    cpus_of = {thread: cpus for thread, cpus in seen.values()}
    assert all(len(cpus) == 1 for cpus in cpus_of.values()), cpus_of
    assert sorted(min(cpus) for cpus in cpus_of.values()) == sorted(where), cpus_of
    after = parallel_map(lambda _: (time.sleep(0.01), os.sched_getaffinity(0))[1], list(range(32)))
    assert after == [set(where)] * 32, "a pool thread kept the CPU it was held to"


def test_the_calling_thread_reads_itself_on_a_cpu_it_may_run_on(tmp_path):
    """The caller waits for the pages anyway: it reads as one of the readers, held to a CPU it
    may run on (vLLM's model thread is pinned to its CPU), so it starts at once and only the
    others wait for a pool thread to wake. It gets its own CPUs back after."""
    where = pool_cpus("io")
    assert len(where) >= 2, f"this test needs 2 CPUs; the io pool runs on {where}"
    store, pages, refs = _published(tmp_path, 4 * len(where))
    caller = threading.get_ident()
    for pinned in (set(where), {where[-1]}):
        on: dict[int, tuple] = {}

        def views_of(i: int) -> list[memoryview]:
            on[i] = (threading.get_ident() == caller, os.sched_getaffinity(0))
            time.sleep(0.02)
            return [memoryview(bytearray(len(pages[i])))]

        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, pinned)
        try:
            store.read_pages_into(refs, views_of)
            assert os.sched_getaffinity(0) == pinned, "the caller did not get its CPUs back"
        finally:
            os.sched_setaffinity(0, before)
        cpu = min(pinned)
        mine = {i: cpus for i, (by_caller, cpus) in on.items() if by_caller}
        assert mine and all(cpus == {cpu} for cpus in mine.values()), f"pinned to {pinned}: {mine}"
        assert all(cpus != {cpu} for i, (by_caller, cpus) in on.items() if not by_caller)


def test_every_reader_has_ended_before_an_error_is_raised(tmp_path):
    """A failure in one reader (here not a refused object) is raised only once the other
    readers have stopped writing into the caller's buffers: vLLM recomputes those blocks as
    soon as it hears of the failure."""
    where = pool_cpus("io")
    assert len(where) >= 2, f"this test needs 2 CPUs; the io pool runs on {where}"
    store, pages, refs = _published(tmp_path, len(where))
    views = [[memoryview(bytearray(len(p)))] for p in pages]
    meet = threading.Barrier(len(where))

    def views_of(i: int) -> list[memoryview]:
        meet.wait(10)  # every reader holds a page
        if i == 0:
            raise RuntimeError("a reader's own failure")
        time.sleep(0.3)  # the others are still reading when the first fails
        return views[i]

    with pytest.raises(RuntimeError, match="a reader's own failure"):
        store.read_pages_into(refs, views_of)
    assert [bytes(v[0]) for v in views[1:]] == pages[1:]


def test_an_unforeseen_error_while_checking_stops_every_run_instead_of_hanging(tmp_path):
    """The runs wait for each other before they write; one that fails in its check with
    anything at all (here a ref whose size is no number) releases the others, which write
    nothing, and its error is raised: the model's thread never waits forever."""
    where = pool_cpus("io")
    assert len(where) >= 2, f"this test needs 2 CPUs; the io pool runs on {where}"
    store, pages, refs = _published(tmp_path, 2 * len(where))
    refs = [*refs[:-1], dataclasses.replace(refs[-1], size=None)]
    views = [[memoryview(bytearray(len(p)))] for p in pages]
    raised: list[BaseException] = []

    def restore() -> None:
        try:
            store.read_pages_into(refs, lambda i: views[i])
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)

    reader = threading.Thread(target=restore, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "the restore hangs: a run waits for one that failed"
    assert [type(e) for e in raised] == [TypeError]
    assert not any(any(bytes(v[0])) for v in views), "a run wrote although another had failed"


def test_held_to_keeps_the_thread_on_one_cpu_and_gives_its_cpus_back():
    before = os.sched_getaffinity(0)
    cpu = max(before)
    with held_to(cpu):
        assert os.sched_getaffinity(0) == {cpu}
    assert os.sched_getaffinity(0) == before
    with held_to(4096):  # no such CPU: the thread stays where it may run
        assert os.sched_getaffinity(0) == before
    assert os.sched_getaffinity(0) == before


def test_a_reader_that_is_slowed_leaves_its_pages_to_the_others(tmp_path):
    """In the engine a pool reader may share its CPU with a process that polls (vLLM's engine
    core waits for the step's result that way) or wake late: the pages are not dealt out in
    fixed runs but taken one after another by whichever reader is free, so the caller reads
    on while the slowed reader holds up one page, not half the restore."""
    where = pool_cpus("io")
    assert len(where) >= 2, f"this test needs 2 CPUs; the io pool runs on {where}"
    store, pages, refs = _published(tmp_path, 8 * len(where))
    caller = threading.get_ident()
    by: dict[int, bool] = {}

    def views_of(i: int) -> list[memoryview]:
        by[i] = threading.get_ident() == caller
        if not by[i]:
            time.sleep(0.5)  # a reader held up: off its CPU for the rest of the restore
        return [memoryview(bytearray(len(pages[i])))]

    store.read_pages_into(refs, views_of)
    slowed = sorted(i for i, mine in by.items() if not mine)
    assert len(slowed) <= len(where) - 1, f"the slowed readers were left pages {slowed}"
    assert sorted(by) == list(range(len(refs)))


@pytest.fixture
def spinning():
    """``cpus.note_spinning_cpus`` for the test; none noted after it."""
    yield cpus.note_spinning_cpus
    cpus.note_spinning_cpus({})


def test_no_reader_runs_on_a_cpu_the_models_openmp_threads_spin_on(tmp_path, spinning):
    """vLLM binds the model's OpenMP threads to CPUs (``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``,
    as its CPU worker sets them), and after each parallel region they spin there at normal
    priority, right when a step's restore starts: a reader woken on such a CPU waited behind
    the spin for up to a scheduler tick. The readers run on the caller's CPU (the model's
    thread, pinned to one of them) and on the CPUs no OpenMP thread is bound to."""
    where = pool_cpus("io")
    assert len(where) >= 2, f"this test needs 2 CPUs; the io pool runs on {where}"
    store, pages, refs = _published(tmp_path, 4 * len(where))
    caller = threading.get_ident()
    by: dict[int, tuple] = {}

    def views_of(i: int) -> list[memoryview]:
        by[i] = (threading.get_ident() == caller, frozenset(os.sched_getaffinity(0)))
        time.sleep(0.01)  # a reader on another CPU, were there one, is up before the pages run out
        return [memoryview(bytearray(len(pages[i])))]

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {where[0]})  # as vLLM pins the model's thread
    try:
        spinning({"GOMP_CPU_AFFINITY": " ".join(map(str, where))})  # every CPU computes for the model
        store.read_pages_into(refs, views_of)
        assert sorted(by) == list(range(len(refs)))
        assert all(mine for mine, _ in by.values()), f"a reader ran off the caller's thread: {by}"
        by.clear()
        spinning({"KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{where[0]}]"})  # the caller's only
        store.read_pages_into(refs, views_of)
        others = {on for mine, on in by.values() if not mine}
        assert others, f"no reader ran on the CPUs left free: {by}"
        assert all(len(on) == 1 and where[0] not in on for on in others), by
    finally:
        os.sched_setaffinity(0, before)
