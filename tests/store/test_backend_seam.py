"""The object backend is the one door to the page objects: a publication writes every object
through the backend's put, the collector deletes them through its delete, and the view learns
what is there through its batch exists. The backend here is the real local one, a subclass
that notes what goes through its interface; nothing else in the store is replaced."""

from __future__ import annotations

import os

from sparkcache.store.backend import NewObject, PutReceipt
from sparkcache.store.objects import LocalBackend
from store_helpers import IDENT, conv_keys, conv_pages, open_store


class RecordingBackend(LocalBackend):
    """The local backend, noting each object handed to a put, each receipt, each delete and
    each digest asked about."""

    def __init__(self, layout, alloc_unit):
        super().__init__(layout, alloc_unit)
        self.handed: list[str] = []
        self.placed: set[str] = set()
        self.deleted: list[str] = []
        self.asked: set[str] = set()

    def put_batch(self, temps, *, cached=True):
        return _RecordingBatch(super().put_batch(temps, cached=cached), self)

    def exists(self, digests):
        digests = list(digests)
        self.asked.update(digests)
        return super().exists(digests)

    def delete(self, digest):
        self.deleted.append(digest)
        return super().delete(digest)


class _RecordingBatch:
    """The local backend's own batch, its calls noted on the way through."""

    def __init__(self, batch, recorder: RecordingBackend) -> None:
        self._batch, self._recorder = batch, recorder

    def add(self, obj: NewObject) -> None:
        self._recorder.handed.append(obj.ref.digest)
        self._batch.add(obj)

    def flush(self) -> PutReceipt:
        receipt = self._batch.flush()
        self._recorder.placed |= receipt.written
        return receipt

    def close(self) -> None:
        self._batch.close()


def _object_files(root: str) -> set[str]:
    return {os.path.basename(d) + f for d, _, files in os.walk(root) for f in files}


def test_every_object_a_publication_writes_goes_through_the_backends_put(tmp_path):
    store = open_store(tmp_path, backend=RecordingBackend)
    backend = store.objects
    assert isinstance(backend, RecordingBackend)
    pages = conv_pages(1, 12, 4)
    first = store.publish(IDENT, conv_keys(1, 12), pages, state=b"s" * 100)
    assert first.ok and first.pages_written == 3, first  # the state is not a page
    stored = store.entry(first.entry_id).manifest
    digests = {ref.digest for ref in stored.objects}
    assert backend.handed == [ref.digest for ref in stored.objects]  # each once, in page order
    assert backend.placed == digests == _object_files(store.layout.objects_dir)
    assert digests <= backend.asked  # each looked up before it was written

    # growth reuses the stored pages: only the new ones are put, and what is on disk is
    # exactly what went through the backend
    grown = store.publish(IDENT, conv_keys(1, 16), [None, None, None, conv_pages(1, 16, 4)[3]])
    assert grown.ok and grown.pages_written == 1 and grown.pages_reused == 3, grown
    assert len(backend.handed) == 5
    assert backend.placed == _object_files(store.layout.objects_dir)

    # a publication whose page is already stored under another entry puts nothing
    again = store.publish(IDENT, conv_keys(2, 4), [pages[0]])
    assert again.ok and again.pages_written == 0 and len(backend.handed) == 5, again


def test_the_collector_deletes_objects_through_the_backend(tmp_path):
    store = open_store(tmp_path, backend=RecordingBackend)
    result = store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    own = {ref.digest for ref in store.entry(result.entry_id).manifest.objects}
    assert store.discard([result.entry_id]) == (result.entry_id,)
    assert set(store.objects.deleted) == own
    assert _object_files(store.layout.objects_dir) == set()
