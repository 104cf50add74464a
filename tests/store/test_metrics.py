"""Metric names, the capacity line, and that each store can have its own registry."""

import re

from sparkcache.metrics import StoreMetrics, render_capacity_line
from sparkcache.store import CapacitySnapshot
from store_helpers import IDENT, conv_keys, conv_pages, open_store


def test_capacity_line_format():
    snap = CapacitySnapshot(entries=1251, used_bytes=int(142.3 * (1 << 30)), max_bytes=160 << 30,
                            low_watermark_bytes=128 << 30, bad_manifests=0)
    assert render_capacity_line([snap]) == \
        "sparkcache: capacity ranks=1 entries=1251 used=142.3/160.0GiB healthy=yes"
    over = CapacitySnapshot(10, 170 << 30, 160 << 30, 128 << 30, 0)
    assert render_capacity_line([snap, over]).endswith("healthy=no")
    assert render_capacity_line([snap, over]).startswith("sparkcache: capacity ranks=2 entries=1261 ")


def test_store_events_drive_metrics(tmp_path):
    m = StoreMetrics()
    store = open_store(tmp_path, page_blocks=4, metrics=m)
    store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    store.lookup(IDENT, ["nothing"])
    text = m.render()
    names = set(re.findall(r"^(vllm:sparkcache_[a-z_]+)", text, re.M))
    for expected in (
            "publication_pending_slots", "publication_pending_bytes",
            "publication_oldest_pending_age_seconds", "maintenance_active",
            "maintenance_remaining_entries", "maintenance_last_pass_duration_seconds",
            "maintenance_last_pass_entries", "maintenance_last_pass_bytes", "evictions_total",
            "bytes_reclaimed_total", "capacity_used_bytes", "capacity_limit_bytes", "entries",
            "publish_failures_total", "lookup_misses_total"):
        assert "vllm:sparkcache_" + expected in names, expected
    assert m.lookup_misses("not_found") == 1
    assert 'vllm:sparkcache_entries{rank="0"} 1.0' in text
    # a second store with its own registry does not collide
    StoreMetrics()


def test_backlog_gauges():
    m = StoreMetrics()
    m.publication_queued("a", 100)
    m.publication_queued("b", 50)
    assert m.pending_slots._value.get() == 2 and m.pending_bytes._value.get() == 150
    m.publication_done("a")
    m.publication_done("b")
    assert m.pending_slots._value.get() == 0 and m.oldest_pending_age._value.get() == 0
