"""PageStore: publish, look up and read identity-bound, verified, copy-on-write entries.

Publication order (crash-safe): declare objects in a locked intent -> put missing page
objects through the backend (temp, fdatasync, rename unless present) -> fsync their
directories -> write the manifest (temp, fdatasync, rename) -> fsync its directory -> drop
the intent. A crash at any point leaves either the complete entry or no entry; the leftovers
are collected later.

The store is three parts behind this one way in: the object backend (``objects``, a
``LocalBackend``: put-if-absent, verified get, batch exists, list, delete, and the restore's
reads straight into buffers), the catalog (``catalog``: the manifests and their in-memory
index) and the collector (``collector``: eviction, deferred deletions, the orphan sweep,
with its own state). Each part, and each publication's ``PublicationWriter``, receives the
parts it uses (the layout, the backend, the staging, the lock), never the store. Several
processes may share one root; the cross-process rules live in ``locks``, ``staging`` and
``pins``. Inside one process, ``_mutex`` guards the catalog; the collector receives it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Sequence

from .accesses import AccessRecorder
from .backend import ObjectError
from .catalog import Catalog
from .clocks import SYSTEM_CLOCK, Clock
from .collector import Collector
from .identity import BlockHash, Identity, block_keys, entry_id_for
from .index import BadManifest, IndexedEntry, ManifestLimits
from .layout import StoreLayout, UnsafePathError, allocated
from .locks import PIN_WAIT_S, PUBLISH_WAIT_S, shared_lock
from .manifests import MAX_MANIFEST_BYTES, Manifest, PageRef, decode, encode, pages_needed
from .objects import LocalBackend
from .publication import BaseObjectGone, PublicationWriter
from .pins import create_pin, live_pins, release_pin
from .reasons import Reason
from .results import (CapacitySnapshot, EntryHandle, LookupResult, PublishResult, ReadResult,
                      RecoveryReport, os_failure)
from .staging import Staging, read_live_intents
from .streams import PageSourceError, PageStream
from .verify import VerifyReport, verify_store
from .writers import claim_writer
from ..settings import Settings, check_number, format_bytes


class _NotTheObject(Exception):
    """An adopted entry's object whose bytes are not what its manifest records."""


LOOKUP_REFRESH_S = 0.0002  # the time a lookup spends on other processes' changes (at least one)
_VANISHED_RETRIES = 4  # matches a lookup tries when the best ones were removed by another process


class PageStore:
    clocks: Clock = SYSTEM_CLOCK  # the process's clocks (``clocks.py``); a test sets its own

    def __init__(self, root: str, *, namespace: str = "default", max_bytes: int = 40 << 30,
                 low_watermark_bytes: int = 32 << 30, lease_seconds: float = 300.0,
                 ttl_seconds: float = 0.0, page_blocks: int = 16,
                 read_only: bool = False, min_free_bytes: int = 0,
                 backend: Callable[[StoreLayout, int], LocalBackend] = LocalBackend) -> None:
        """A writer recovers dead publications on open, and joins the store's writers: one
        whose cap (``max_bytes``, ``low_watermark_bytes``) differs from the live writers' is
        refused with a ``SettingsError`` (``writers.py``). ``read_only``: a reader that writes
        nothing under the root (restore-only, the CLI's status and inspect; works on a
        read-only mount): no directories made, no recovery, lookups neither record the
        access nor pin (a lease is None), publishing refused. ``backend``: makes the object
        backend from the layout and the filesystem's allocation unit (a test passes a
        ``LocalBackend`` subclass that records what goes through it)."""
        def check(name: str, value: object, **bounds: object) -> None:  # NaN, inf, -1: refused
            check_number("PageStore", name, value, setting="SPARKCACHE_" + name.upper(), **bounds)

        check("max_bytes", max_bytes, minimum=1, integer=True, unit="bytes")
        check("low_watermark_bytes", low_watermark_bytes, minimum=0, maximum=max_bytes,
              integer=True, unit="bytes, at most max_bytes")
        check("min_free_bytes", min_free_bytes, minimum=0, integer=True, unit="bytes")
        check("lease_seconds", lease_seconds, above=0, unit="seconds")
        check("ttl_seconds", ttl_seconds, minimum=0, unit="seconds; 0: no TTL")
        check("page_blocks", page_blocks, minimum=1, integer=True, unit="blocks")
        self.read_only = read_only
        self.namespace = namespace
        self.layout = StoreLayout.create(root, namespace, make=not read_only)
        # every writer of the store uses one cap (SettingsError otherwise; writers.py)
        self._claim = None if read_only else claim_writer(self.layout, max_bytes, low_watermark_bytes)
        unit = os.statvfs(self.layout.base).f_frsize or 4096
        self.objects = backend(self.layout, unit)
        self.max_bytes = max_bytes
        self.low_watermark_bytes = low_watermark_bytes
        self.min_free_bytes = min_free_bytes  # free-space floor of the filesystem (0: none)
        self.free_wanted = 0  # bytes the last publication refused under the floor needed
        self.lease_seconds = lease_seconds
        self.ttl_seconds = ttl_seconds
        self.page_blocks = page_blocks
        self.catalog = Catalog(self.layout, unit, self.objects, ManifestLimits.for_store(max_bytes, unit))
        self._mutex = threading.RLock()
        self.collector = Collector(self.layout, self.catalog, self.objects, self._mutex)
        self.accesses = AccessRecorder(self.layout, self.catalog.index.journal, self.catalog.stamped)
        self.last_recovery: RecoveryReport | None = None
        if not read_only:
            try:
                self.catalog.index.journal.create()
            except OSError:
                pass  # a read-only or failing disk: the listing below says what it can
            self.recover()
        else:
            with self._mutex:
                self.catalog.refresh(full=True)

    def close(self) -> None:
        """Leave the store's writers (a writer holds its claim until then, until it is
        collected, or until the process ends) and close the journal's read descriptor (a
        lookup after this opens it again)."""
        self.accesses.flush()
        if self._claim is not None:
            self._claim.close()
        self.catalog.index.journal.close()

    @classmethod
    def from_settings(cls, settings: Settings, *, read_only: bool = False) -> "PageStore":
        return cls(settings.root, namespace=settings.namespace, max_bytes=settings.max_bytes,
                   low_watermark_bytes=settings.low_watermark_bytes,
                   lease_seconds=settings.lease_seconds, ttl_seconds=settings.ttl_seconds,
                   page_blocks=settings.page_blocks, read_only=read_only,
                   min_free_bytes=settings.min_free_bytes)

    # ------------------------------------------------------------------ startup

    def recover(self) -> RecoveryReport:
        """Remove workspaces of dead publications; load every complete manifest.

        Incomplete publications are invisible by construction (no manifest was renamed);
        the objects they wrote are collected by maintenance's orphan sweep.
        """
        try:  # a dead publisher may have left a manifest it never journaled: all list again
            _, cleaned = read_live_intents(self.layout, remove_stray_dirs=True,
                                           before_removal=self._ask_rescan)
        except OSError:
            cleaned = 0  # staging cannot be read now: its leftovers wait for the next writer
        with self._mutex:
            self.catalog.refresh(full=True)
            report = RecoveryReport(cleaned, self.catalog.entry_count, self.catalog.bad_count)
        self.last_recovery = report
        return report

    def _ask_rescan(self) -> None:
        with self._mutex:
            self.catalog.ask_rescan()

    # ------------------------------------------------------------------ publish

    def publish(self, identity: Identity, block_hashes: Sequence[BlockHash],
                pages: Sequence[bytes | memoryview | None] | PageStream, *,
                blocks_per_page: int | None = None,
                state: bytes | memoryview | None = None,
                pace: Callable[[], None] | None = None) -> PublishResult:
        """Publish the prefix ``block_hashes`` with its page bytes.

        A page (and ``state``) is any C-contiguous buffer, stored as its bytes in row-major
        order whatever its shape or item format (``buffers.byte_view``); one that is not
        C-contiguous is a ValueError, something that is not a buffer a TypeError.

        ``pages[i]`` holds blocks ``[i*bpp, (i+1)*bpp)`` (the last page may be short). A page
        given as ``None`` is taken from the stored entry that already holds exactly those
        blocks (copy-on-write growth without re-capturing); page objects that already exist
        are reused, never rewritten. ``pages`` may be a ``PageStream`` (its pages produced a
        chunk at a time, so an entry of any length goes through a bounded buffer; a producer
        that fails refuses the publication with ``source_failed``). ``state``: a hybrid
        model's recurrent state after the last block, stored as one more object of the entry.
        ``pace``: called before each chunk of pages is hashed and each page is put; the
        publication waits while it does (the connector holds publication there while the
        model prefills).
        """
        if self.read_only:
            raise PermissionError(f"{self.layout.base}: opened read-only; publishing needs a "
                                  "writer (read-write or store-only)")
        started = time.monotonic()
        # any C-contiguous buffer, by its bytes: len() of a 2-D or typed view is not its size
        stream = pages if isinstance(pages, PageStream) else PageStream.of(pages)
        if state is not None:
            stream = stream.followed_by(state)
        sizes = stream.sizes[:len(stream.sizes) - (state is not None)]
        bpp = blocks_per_page or self.page_blocks
        keys = block_keys(block_hashes)
        if not keys:
            raise ValueError("publish: block_hashes is empty; an entry holds at least one block")
        if len(sizes) != pages_needed(len(keys), bpp):
            raise ValueError(f"publish: {len(sizes)} pages for {len(keys)} blocks at {bpp} "
                             f"blocks/page; expected {pages_needed(len(keys), bpp)}")
        idd = identity.digest()
        entry_id = entry_id_for(idd, keys[-1])
        with self._mutex:
            self.catalog.refresh()
            refused = self._no_room(stream, entry_id, started)
            if refused is not None:
                return refused
            try:
                reused_refs = self._resolve_missing_pages(idd, keys, bpp, sizes)
            except LookupError as exc:
                return self._failed(Reason.BASE_ABSENT, started, entry_id, str(exc))
        declared = stream.given_bytes + sum(r.size for r in reused_refs.values())
        too_much = self.catalog.limits.refusal_of(len(stream.sizes), declared, len(keys))
        if too_much is not None:
            return self._failed(Reason.OVER_CAPACITY, started, entry_id, too_much)

        def manifest_of(refs: list[PageRef]) -> bytes:
            state_ref = refs.pop() if state is not None else None
            return encode(Manifest(entry_id, identity, tuple(keys), bpp, tuple(refs), time.time(), state_ref))

        return self._write_entry(idd, entry_id, keys, stream, reused_refs, manifest_of, pace, started)

    def adopt(self, data: bytes, objects: Sequence[bytes | bytearray | memoryview] | PageStream, *,
              cached: bool = True) -> PublishResult:
        """Publish an entry as another store published it: ``data``, its manifest file's bytes
        (kept verbatim), and ``objects``, the bytes of every object it names (``Manifest.objects``
        order: its pages, then its state), in memory or as a ``PageStream`` (a chunk at a time,
        as a fetch from the shared tier hands them while it GETs the next ones; a source that
        fails refuses the publication with ``source_failed``). It goes the way ``publish`` goes
        (the cap, the free-space floor, the writer's crash-safe order, the journal), so the
        entry, its objects and its manifest are what a publication here would have made.
        ``cached=False`` writes the objects past the page cache where the filesystem allows
        (O_DIRECT: a fetch's bytes, which no copy into new page-cache pages need slow down;
        the restore that follows reads them from the disk).
        ``ManifestError`` for ``data`` that does not decode; an object whose bytes are not what
        the manifest records refuses the publication (``corrupt``) before its manifest is placed."""
        if self.read_only:
            raise PermissionError(f"{self.layout.base}: opened read-only; adopting an entry needs a writer")
        started = time.monotonic()
        manifest = decode(data)
        wanted = manifest.objects
        stream = objects if isinstance(objects, PageStream) else PageStream.of(list(objects))
        if len(stream.sizes) != len(wanted):
            raise ValueError(f"adopt {manifest.entry_id}: {len(stream.sizes)} objects given, its manifest "
                             f"names {len(wanted)}; pass its pages, then its state")
        entry_id, idd = manifest.entry_id, manifest.identity_digest
        with self._mutex:
            self.catalog.refresh()
            refused = self._no_room(stream, entry_id, started)
            if refused is not None:
                return refused
        too_much = self.catalog.limits.refusal(manifest)
        if too_much is not None:
            return self._failed(Reason.OVER_CAPACITY, started, entry_id, too_much)

        def manifest_of(refs: list[PageRef]) -> bytes:
            for got, ref in zip(refs, wanted):
                if (got.digest, got.size) != (ref.digest, ref.size) or ref.checksum not in (None, got.checksum):
                    raise _NotTheObject(f"object {ref.digest} of entry {entry_id}: the bytes given hash "
                                        f"to {got.digest} ({got.size} bytes); fetch it again")
            return data

        return self._write_entry(idd, entry_id, list(manifest.block_keys), stream, {}, manifest_of, None, started,
                                 cached=cached)

    def _no_room(self, stream: PageStream, entry_id: str, started: float) -> PublishResult | None:
        """[mutex] The refusal of a publication of ``stream``'s new objects that the cap or the
        free-space floor forbids; None when it may go on."""
        if self.catalog.used_bytes > self.max_bytes:
            return self._failed(Reason.OVER_CAPACITY, started, entry_id,
                                f"store holds {self.catalog.used_bytes} bytes, above "
                                f"max_bytes={self.max_bytes}; maintenance will evict down to "
                                "the low watermark (raise SPARKCACHE_MAX_BYTES if this is frequent)")
        # what this publication allocates at most: its new objects and the manifest
        unit = self.catalog.alloc_unit
        incoming = sum(allocated(n, unit) for n in stream.sizes if n is not None) + unit
        if self.free_space_deficit(incoming) > 0:
            # maintenance frees what this publication needed, not only what the floor does
            self.free_wanted = max(self.free_wanted, incoming)
            return self._failed(Reason.LOW_FREE_SPACE, started, entry_id,
                                f"the filesystem under {self.layout.base} would keep "
                                f"{format_bytes(max(0, self.free_bytes() - incoming))} free after "
                                f"this publication, under SPARKCACHE_MIN_FREE_BYTES="
                                f"{format_bytes(self.min_free_bytes)}; maintenance evicts to "
                                "restore it (free space on the volume, or lower the floor)")
        return None

    def _write_entry(self, idd: str, entry_id: str, keys: list[str], stream: PageStream,
                     reused_refs: dict[int, PageRef], manifest_of: Callable[[list[PageRef]], bytes],
                     pace: Callable[[], None] | None, started: float, *, cached: bool = True) -> PublishResult:
        """Write the objects of ``stream`` and then the manifest ``manifest_of`` makes of their
        refs (``PublicationWriter``'s order), journal it and read it into the view."""
        staging = Staging(self.layout)
        writer = PublicationWriter(self.layout, self.objects, staging, pace, cached=cached)
        try:
            staging.open()
            refs = writer.write_pages(stream, reused_refs)
            data = manifest_of(refs)  # publish's takes the state's ref off: it counts pages
            try:
                writer.commit(staging.temp_path("manifest"), data, self.catalog.manifest_path(idd, entry_id),
                              lambda: self.catalog.make_identity_dir(idd))
                with shared_lock(self.layout, PUBLISH_WAIT_S):  # no journal rotation meanwhile
                    self.catalog.published(idd, entry_id)
            except BaseException:
                # From the rename on (its directory's fsync, the journal) the manifest may be
                # in place, not journaled: the abandoned intent asks every process for a rescan
                # (its objects are garbage only to a view that lists it).
                if writer.placing:
                    staging.abandon()
                raise
        except BaseObjectGone as exc:
            return self._failed(Reason.BASE_ABSENT, started, entry_id, str(exc))
        except PageSourceError as exc:
            return self._failed(Reason.SOURCE_FAILED, started, entry_id, str(exc))
        except _NotTheObject as exc:
            return self._failed(Reason.CORRUPT, started, entry_id, str(exc))
        except (OSError, UnsafePathError) as exc:  # LockTimeout is an OSError too
            reason, detail = os_failure(exc)
            return self._failed(reason, started, entry_id, detail)
        finally:
            writer.close()
            staging.close()
        written = sum(1 for r in refs if r.digest in writer.receipt.written)
        bytes_written = writer.receipt.bytes_written
        with self._mutex:
            self.catalog.add_published(idd, entry_id)
            self.free_wanted = 0
        superseded = self._supersede_shorter(idd, keys)
        return PublishResult(True, Reason.PUBLISHED, entry_id, "", written, len(refs) - written,
                             bytes_written, superseded, time.monotonic() - started)

    def manifest_bytes(self, entry_id: str) -> tuple[Manifest, bytes] | None:
        """The entry's manifest and its file's bytes as they are on disk (checked: they decode
        to this entry); None when the store no longer holds it. ``ManifestError`` for a file
        that does not decode, the filesystem's ``OSError`` for one that cannot be read."""
        entry = self.entry(entry_id)
        if entry is None:
            return None
        try:
            fd = self.layout.open_file(entry.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        try:
            chunks, got = [], 1
            while got and sum(map(len, chunks)) <= MAX_MANIFEST_BYTES:
                chunks.append(os.read(fd, MAX_MANIFEST_BYTES + 1))
                got = len(chunks[-1])
            data = b"".join(chunks)
        finally:
            os.close(fd)
        return decode(data, expected_entry_id=entry_id, expected_identity_digest=entry.manifest.identity_digest), data

    def _resolve_missing_pages(self, idd: str, keys: list[str], bpp: int,
                               sizes: Sequence[int | None]) -> dict[int, PageRef]:
        wanted = [i for i, n in enumerate(sizes) if n is None]
        if not wanted:
            return {}
        entry, depth = self.catalog.longest_match(idd, keys)
        out: dict[int, PageRef] = {}
        for i in wanted:
            end_new = min((i + 1) * bpp, len(keys))
            if (entry is None or entry.manifest.blocks_per_page != bpp or end_new > depth
                    or min((i + 1) * bpp, entry.manifest.block_count) != end_new):
                raise LookupError(
                    f"page {i} (blocks {i * bpp}..{end_new}) was given as None but no stored "
                    f"entry holds exactly those blocks at {bpp} blocks/page; pass its bytes")
            out[i] = entry.manifest.pages[i]
        return out

    def _supersede_shorter(self, idd: str, keys: list[str]) -> tuple[str, ...]:
        """Evict entries that the new one extends (their blocks are all in it and they hold no
        recurrent state), unless pinned.
        Best effort: skipped when the collector holds the lock."""
        with self._mutex:
            shorter = self.catalog.entries_ending_within(idd, keys)
        return self.discard(shorter) if shorter else ()

    def discard(self, entry_ids: Sequence[str]) -> tuple[str, ...]:
        """Remove these entries now (manifests, one fsync, then the objects only they
        referenced), except pinned ones; returns those removed. Best effort: nothing when
        the collector holds the lock or the disk fails (the caller may try again later)."""
        if self.read_only:
            raise PermissionError(f"{self.layout.base}: opened read-only; removing entries needs a writer")
        return self.collector.discard(entry_ids, self.lease_seconds, self.clocks)

    def _failed(self, reason: Reason, started: float, entry_id: str, detail: str) -> PublishResult:
        return PublishResult(False, reason, entry_id, detail, duration_s=time.monotonic() - started)

    # ------------------------------------------------------------------ lookup / read

    def lookup(self, identity: Identity, block_hashes: Sequence[BlockHash], *,
               lease: bool = False, verify: bool = False, with_state: bool = False) -> LookupResult:
        """The longest stored prefix of ``block_hashes`` for ``identity`` (with ``with_state``:
        the longest that ends with a recurrent state, see ``EntryIndex.longest_match``).

        Every page of the hit is checked (present, regular, right size; with ``verify``
        also re-hashed). A broken entry is a miss with reason ``corrupt`` or ``absent``.
        With ``lease`` the entry is pinned (release with ``release``), unless the store is
        read-only: a reader that writes nothing cannot pin (its reads are verified anyway).
        """
        keys = block_keys(block_hashes)
        idd = identity.digest()
        try:
            return self._lookup(idd, keys, lease, verify, with_state)
        except (OSError, UnsafePathError) as exc:  # a full, read-only or failing disk; a lock
            reason, detail = os_failure(exc)       # held past its bound: a miss, never a raise
            return self._miss(reason, None, detail)

    def _lookup(self, idd: str, keys: list[str], lease: bool, verify: bool,
                with_state: bool) -> LookupResult:
        with self._mutex:
            self.catalog.refresh(budget_s=LOOKUP_REFRESH_S)
        for _ in range(_VANISHED_RETRIES):
            with self._mutex:
                entry, depth = self.catalog.longest_match(idd, keys, with_state=with_state)
                refused = self.catalog.refused_deeper(idd, keys, depth)
            if entry is None:
                if refused is not None:
                    return self._miss(refused.reason, refused.entry_id,
                                      f"manifest {refused.path}: {refused.detail}")
                return self._miss(Reason.NOT_FOUND, None, "no stored prefix for this identity")
            pages = list(entry.manifest.pages_for_blocks(depth))
            if with_state:
                pages.append(entry.manifest.state)
            try:
                self.objects.check_many_present(pages)
                if verify:  # one page in memory at a time: an entry can be many GiB
                    for page in pages:
                        self.objects.check_ref(page)
                break
            except ObjectError as exc:
                if not self._vanished(entry):
                    return self._miss(exc.reason, entry.entry_id, str(exc))
                # removed by another process, its record not applied yet: the next best match
        else:
            return self._miss(Reason.ABSENT, None, "the entries found were being removed")
        handle = _handle_of(entry)
        lease_id = None
        if lease and not self.read_only:
            lease_id = self.pin(entry.entry_id, idd)
            if lease_id is None:
                return self._miss(Reason.ABSENT, entry.entry_id, "entry was evicted during the lookup")
        if not self.read_only:
            self.accesses.record(entry)  # stamped off this thread (accesses.py)
        return LookupResult(depth, entry.entry_id, Reason.HIT, "", handle, lease_id)

    def read(self, handle: EntryHandle, n_blocks: int | None = None) -> ReadResult:
        """Verified bytes of the pages holding the first ``n_blocks`` blocks."""
        n_blocks = handle.block_count if n_blocks is None else n_blocks
        if not 0 < n_blocks <= handle.block_count:
            raise ValueError(f"read: n_blocks={n_blocks} outside 1..{handle.block_count}")
        try:
            pages = self.read_pages(handle.pages[: pages_needed(n_blocks, handle.blocks_per_page)])
        except ObjectError as exc:
            return ReadResult(exc.reason, bad_digest=exc.digest, detail=str(exc))
        return ReadResult(Reason.HIT, n_blocks, handle.blocks_per_page, tuple(pages))

    def read_pages(self, refs: Sequence[PageRef], *, parallel: bool = True) -> list[bytearray]:
        """Verified page objects in order, read on parallel threads or, with
        ``parallel=False``, on this one. A page that fails is raised as ``ObjectError`` with
        its reason (an I/O error included: reads never fault the process); nothing
        unverified is returned."""
        return self.objects.read_many_verified(list(refs), parallel=parallel)

    def read_pages_into(self, refs: Sequence[PageRef], views_of) -> None:
        """Page objects read straight into buffers and verified there: ``views_of(i)`` gives
        the writable buffers of ``refs[i]``, in order (``LocalBackend.read_verified_into``).
        Every object is checked present first, so an entry evicted before the restore writes
        nothing; an ``ObjectError`` while reading (one evicted during it included) leaves
        unverified bytes in the buffers, which the caller must not use."""
        self.objects.read_many_verified_into(list(refs), views_of)

    def check_pages_present(self, refs: Sequence[PageRef]) -> None:
        """Raise ``ObjectError`` (absent, or not the object it should be) for the first of
        ``refs`` whose object is not there, whole: nothing read, nothing hashed."""
        self.objects.check_many_present(list(refs))

    def read_page_into(self, ref: PageRef, buffer: memoryview) -> None:
        """One page object read into ``buffer`` (its exact size) and verified there
        (``LocalBackend.read_verified_into``); an ``ObjectError`` leaves unverified bytes."""
        self.objects.read_verified_into(ref, [buffer])

    def start_readers(self) -> None:
        """Start the threads restores read on now (``LocalBackend.start_readers``)."""
        self.objects.start_readers()

    def discard_corrupt(self, digest: str, size: int) -> bool:
        """Remove a page object found corrupt, so that the next publication of its prefix writes
        it anew; False when it is no longer there or no longer corrupt."""
        return self.objects.discard_corrupt(digest, size)

    def quarantine(self, entry_id: str, ref: PageRef) -> str:
        """After a restore of entry ``entry_id`` refused object ``ref`` as corrupt: remove what
        is wrong, so the next capture of that prefix stores it anew. ``"object"``: the bytes did
        not match their name (the object is removed); ``"entry"``: they match their name but
        not the checksum the manifest records (the entry is removed, with the objects only it
        referenced, as any discard); ``""``: nothing found wrong now (rewritten meanwhile, gone,
        unreadable)."""
        try:
            self.objects.check_ref(ref)
        except ObjectError as exc:
            if exc.reason != Reason.CORRUPT:
                return ""
            if self.objects.discard_corrupt(ref.digest, ref.size):
                return "object"
            return "entry" if self.discard([entry_id]) else ""
        return ""

    def fetch(self, identity: Identity, block_hashes: Sequence[BlockHash]) -> tuple[LookupResult, ReadResult | None]:
        """Lookup plus verified read of the hit; the read is None on a lookup miss."""
        result = self.lookup(identity, block_hashes, lease=True)
        if not result.hit:
            return result, None
        try:
            return result, self.read(result.handle, result.hit_blocks)
        finally:
            self.release(result.lease_id)

    def _miss(self, reason: Reason, entry_id: str | None, detail: str) -> LookupResult:
        return LookupResult(0, entry_id, reason, detail)

    # ------------------------------------------------------------------ pins

    def pin(self, entry_id: str, identity_digest: str | None = None) -> str | None:
        """Pin an entry for ``lease_seconds``; None if it no longer exists. Raises
        ``LockTimeout`` or the filesystem's error (``lookup`` turns them into misses)."""
        with self._mutex:
            entry = self.catalog.entry(entry_id)
        if entry is None:
            return None
        with shared_lock(self.layout, PIN_WAIT_S):
            lease_id = create_pin(self.layout, entry_id, self.lease_seconds, self.clocks)
            try:
                self.layout.lstat(entry.path)
            except FileNotFoundError:
                release_pin(self.layout, lease_id)
                with self._mutex:
                    self.catalog.drop_vanished(entry)
                return None
        return lease_id

    def _vanished(self, entry: IndexedEntry) -> bool:
        """Whether ``entry`` left the view because its manifest is gone (then it leaves) or
        was replaced (then the new one is read in its place): its missing objects were
        another process's removal, not damage. A manifest that cannot be read keeps what the
        view held (the index's ``unknown``: nothing it may name is deleted meanwhile)."""
        try:
            replaced = self.layout.lstat(entry.path).st_ino != entry.inode
        except FileNotFoundError:
            with self._mutex:
                self.catalog.drop_vanished(entry)
            return True
        except (OSError, UnsafePathError):
            return False
        if not replaced:
            return False
        with self._mutex:
            return self.catalog.reread(entry) is not entry

    def release(self, lease_id: str | None) -> None:
        if lease_id:
            release_pin(self.layout, lease_id)

    # ------------------------------------------------------------------ views

    def capacity(self) -> CapacitySnapshot:
        with self._mutex:
            self.catalog.refresh()
            return CapacitySnapshot(self.catalog.entry_count, self.catalog.used_bytes,
                                    self.max_bytes, self.low_watermark_bytes, self.catalog.bad_count,
                                    len(self.catalog.unknown()))

    def free_bytes(self) -> int:
        """Bytes the filesystem under the store has free for this process (``f_bavail``)."""
        st = os.statvfs(self.layout.base)
        return st.f_bavail * st.f_frsize

    def free_space_deficit(self, incoming: int | None = None) -> int:
        """How many bytes would have to be freed to keep the free-space floor after writing
        ``incoming`` more (default: what the last publication refused under the floor
        needed); 0 when there is no floor or it is kept."""
        incoming = self.free_wanted if incoming is None else incoming
        if self.min_free_bytes <= 0:
            return 0
        try:
            return max(0, self.min_free_bytes + incoming - self.free_bytes())
        except OSError:
            return 0  # a failing filesystem shows itself on the write

    def entries(self) -> list[IndexedEntry]:
        """Every published entry, as the store holds them now."""
        with self._mutex:
            self.catalog.refresh()
            return self.catalog.entries()

    def entry(self, entry_id: str) -> IndexedEntry | None:
        with self._mutex:
            self.catalog.refresh()
            return self.catalog.entry(entry_id)

    def bad_manifests(self) -> list[BadManifest]:
        """Manifest files the store refuses to read (corrupt, unsafe), as it found them now."""
        with self._mutex:
            self.catalog.refresh()
            return self.catalog.bad_manifests()

    def references(self, digest: str) -> int:
        """How many entries reference the object ``digest``."""
        with self._mutex:
            return self.catalog.references(digest)

    def pinned(self, entry_id: str) -> bool:
        """Whether a live (unexpired) pin holds the entry."""
        return entry_id in live_pins(self.layout, self.lease_seconds, self.clocks,
                                     probe=not self.read_only)

    def check_verified(self, ref: PageRef) -> None:
        """Re-hash one object of an entry (its name and the checksum ``ref`` records); raises
        ``ObjectError`` unless a restore of it would succeed."""
        self.objects.check_ref(ref)

    @staticmethod
    def verify_root(root: str, namespace: str = "default") -> VerifyReport:
        """Full integrity sweep of the store at ``root``: every manifest decoded, every
        object re-hashed (read-only; nothing is recovered or loaded first)."""
        return verify_store(StoreLayout.create(root, namespace, make=False))


def _handle_of(entry: IndexedEntry) -> EntryHandle:
    m = entry.manifest
    return EntryHandle(m.entry_id, m.identity_digest, m.block_count, m.blocks_per_page, m.pages,
                       m.state)


