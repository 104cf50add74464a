"""A full filesystem: publication fails cleanly (a value with a fix and a counter), earlier
entries stay readable, nothing half-written is visible, and publishing resumes once space
returns. Uses a real 2 MiB tmpfs (the tests run as root)."""

import os
import subprocess

import pytest

from sparkcache.metrics import StoreMetrics
from sparkcache.store import verify_store
from store_helpers import IDENT, conv_keys, conv_pages, open_store


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    # Not a skip: CI treats a skip as a failure, and this test is required.
    assert proc.returncode == 0, ("cannot mount a tmpfs (run as root, or in a container with "
                                  f"CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_publication_on_full_disk(small_disk):
    metrics = StoreMetrics()
    store = open_store(os.path.join(small_disk, "store"), page_blocks=4, metrics=metrics,
                       max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    filler = os.path.join(small_disk, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (512 << 10))
    published = []
    failure = None
    for conv in range(200):  # 16 KiB per entry: the 2 MiB disk fills well before 200
        result = store.publish(IDENT, conv_keys(conv, 16), conv_pages(conv, 16, 4, 1024))
        if not result.ok:
            failure = result
            break
        published.append(conv)
    assert failure is not None and failure.reason == "no_space", failure
    assert "No space left on device" in failure.detail and "free space" in failure.detail
    assert metrics.publish_failures("no_space") == 1
    assert len(published) > 10
    # earlier entries are all readable and verified; the failed one is simply absent
    for conv in published:
        lookup, read = store.fetch(IDENT, conv_keys(conv, 16))
        assert lookup.hit_blocks == 16 and read.ok
    failed_conv = published[-1] + 1
    assert store.lookup(IDENT, conv_keys(failed_conv, 16)).reason == "not_found"
    assert [n for n in os.listdir(store.layout.staging_dir)] == []
    # more attempts keep failing cleanly while the disk is full
    again = store.publish(IDENT, conv_keys(failed_conv, 16), conv_pages(failed_conv, 16, 4, 1024))
    assert not again.ok and again.reason == "no_space"
    assert metrics.publish_failures("no_space") == 2
    # space returns: publishing resumes
    os.unlink(filler)
    resumed = store.publish(IDENT, conv_keys(failed_conv, 16), conv_pages(failed_conv, 16, 4, 1024))
    assert resumed.ok, resumed
    assert store.fetch(IDENT, conv_keys(failed_conv, 16))[1].ok
    report = verify_store(store.layout)
    assert report.ok, report.problems
