"""An entry of 4,000 pages is published and restored under the common open-file limit of 1,024
(issue 41). ``read_pages`` is the worker's read (``WorkerSide.load``). At 403da3e the worker
mapped every page (``read_pages(..., mapped=True)``) and each mapping kept a duplicate of its
descriptor: this test with that call fails there with "[Errno 24] Too many open files". Reads
now use ``preadv`` on a descriptor closed after its page, and publication syncs temp files in
batches, so neither depends on the entry's length.

The limit applies to a child interpreter only (``resource.setrlimit`` there), never to pytest.
"""

from __future__ import annotations

import subprocess
import sys

from store_helpers import REPO_ROOT

PAGES, LIMIT = 4000, 1024

_CHILD = r"""
import resource, sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests/store"]
PAGES, LIMIT = int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
from store_helpers import IDENT, conv_keys, conv_pages, open_store

store = open_store(sys.argv[1], page_blocks=1)
keys, pages = conv_keys(7, PAGES), conv_pages(7, PAGES, 1, 64)
published = store.publish(IDENT, keys, pages)
assert published.ok, published
for parallel in (True, False):
    hit = store.lookup(IDENT, keys)
    assert hit.hit and hit.hit_blocks == PAGES, hit
    got = store.read_pages(hit.handle.pages, parallel=parallel)
    assert [bytes(p) for p in got] == pages
    store.release(hit.lease_id)
print("limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0], "pages", len(got))
"""


def test_an_entry_of_4000_pages_is_restored_under_a_1024_open_file_limit(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "root"), REPO_ROOT, str(PAGES), str(LIMIT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["limit", str(LIMIT), "pages", str(PAGES)]
