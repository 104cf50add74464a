"""The metric declarations (``sparkcache/metrics.py``), the capacity line, and the gauges an
opened store renders from those declarations; no vLLM here (the CLI imports this module).

The vLLM side (``SparkcacheStats`` refusing undeclared keys, the metrics built on vLLM's
classes, every key the product emits being declared) is ``tests/connector/test_metric_keys.py``.
"""

import os
import re

import pytest

from sparkcache.metrics import (COUNTERS, GAUGES, HISTOGRAMS, PREFIX, UndeclaredMetric,
                                render_capacity_line, render_store_gauges, require_counter,
                                require_gauge, require_histogram, store_gauges)
from sparkcache.store import CapacitySnapshot
from sparkcache.store.reasons import LOOKUP_MISSES, PUBLISH_FAILURES
from store_helpers import IDENT, conv_keys, conv_pages, open_store


def test_capacity_line_format():
    snap = CapacitySnapshot(entries=1251, used_bytes=int(142.3 * (1 << 30)), max_bytes=160 << 30,
                            low_watermark_bytes=128 << 30, bad_manifests=0)
    assert render_capacity_line([snap]) == \
        "sparkcache: capacity ranks=1 entries=1251 used=142.3/160.0GiB healthy=yes"
    over = CapacitySnapshot(10, 170 << 30, 160 << 30, 128 << 30, 0)
    assert render_capacity_line([snap, over]).endswith("healthy=no")
    assert render_capacity_line([snap, over]).startswith("sparkcache: capacity ranks=2 entries=1261 ")


def test_declarations_are_frozen_and_complete():
    decls = (*COUNTERS, *GAUGES, *HISTOGRAMS)
    names = [d.name for d in decls]
    assert len(names) == len(set(names)), names
    for d in decls:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", d.name) and d.help.strip() and d.data_keys, d
        with pytest.raises(AttributeError):  # frozen: a table cannot be edited at run time
            d.name = "other"  # type: ignore[misc]
    # every reason a store outcome can have is a label of its counter
    by_name = {c.name: c for c in COUNTERS}
    assert {v for _, v in by_name["publish_failures"].keys} == set(PUBLISH_FAILURES)
    assert {v for _, v in by_name["lookup_misses"].keys} == set(LOOKUP_MISSES)


@pytest.mark.parametrize("check, key, table", [
    (require_counter, "restores_maybe", "COUNTERS"),
    (lambda k: require_gauge(k, per_rank=True), "used_bites", "GAUGES"),
    (lambda k: require_gauge(k, per_rank=False), "pending_frees", "GAUGES"),
    (require_histogram, "restore_secs", "HISTOGRAMS"),
])
def test_an_undeclared_key_is_refused_naming_it_and_the_table(check, key, table):
    with pytest.raises(UndeclaredMetric, match=rf"'{key}' is not declared; declare it in the {table} table"):
        check(key)


def test_a_gauge_emitted_on_the_wrong_side_is_refused():
    require_gauge("used_bytes", per_rank=True)
    with pytest.raises(UndeclaredMetric, match="declared per_rank=True"):
        require_gauge("used_bytes", per_rank=False)
    with pytest.raises(UndeclaredMetric, match="declared per_rank=False"):
        require_gauge("pending_block_frees", per_rank=True)


def test_the_store_gauges_are_what_an_opened_store_tells(tmp_path):
    store = open_store(tmp_path, page_blocks=4, min_free_bytes=1 << 20)
    store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    gauges = store_gauges(store)
    cap = store.capacity()
    assert {k: gauges[k] for k in ("used_bytes", "max_bytes", "entries")} == \
        {"used_bytes": cap.used_bytes, "max_bytes": cap.max_bytes, "entries": 1}
    assert gauges["floor_bytes"] == 1 << 20 and 0 < gauges["free_bytes"] <= os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    for key in gauges:  # each is a declared per-rank gauge
        require_gauge(key, per_rank=True)


def test_store_gauges_render_with_the_declared_names_and_a_rank_label(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    first = open_store(tmp_path / "a", page_blocks=4)
    first.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    second = open_store(tmp_path / "b", page_blocks=4, max_bytes=2 << 30)
    told = [store_gauges(first), store_gauges(second)]
    families = {f.name: f for f in text_string_to_metric_families(render_store_gauges(told))}
    by_key = {g.key: g for g in GAUGES}
    # only declared names, with their help, each a gauge labelled by rank alone
    assert sorted(families) == sorted(PREFIX + by_key[k].name for k in told[0])
    for key in told[0]:
        family = families[PREFIX + by_key[key].name]
        assert family.type == "gauge" and family.documentation == by_key[key].help
        assert {s.labels["rank"]: s.value for s in family.samples} == {"0": told[0][key], "1": told[1][key]}
        assert all(set(s.labels) == {"rank"} for s in family.samples)
    assert families[PREFIX + "entries"].samples[0].value == 1
    assert PREFIX + "publication_pending_slots" not in families  # a worker's, not the store's


def test_rendering_an_undeclared_gauge_is_refused():
    with pytest.raises(UndeclaredMetric, match="'used_bites'"):
        render_store_gauges([{"used_bites": 1}])


def test_every_metric_the_docs_dashboard_and_alerts_name_is_declared():
    """A name in an alert rule, a dashboard panel or the docs that nothing exports would
    silently match no series."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    from sparkcache.metrics import REMOTE_GC_GAUGES  # what remote-gc --metrics-file writes

    declared = {PREFIX + m.name for m in (*COUNTERS, *GAUGES, *HISTOGRAMS, *REMOTE_GC_GAUGES)}
    files = [*sorted((repo / "docs" / "monitoring").iterdir()), *sorted((repo / "docs").glob("*.md")),
             repo / "README.md"]
    named = {(m, f.name) for f in files if f.is_file()
             for m in re.findall(r"vllm:sparkcache_[a-z_]*[a-z](?![a-z_*])", f.read_text())}  # not `..._pending_*`
    assert {m for m, f in named if f.endswith((".yaml", ".json"))}, "the scan found the alert and dashboard names"
    unknown = sorted((m, f) for m, f in named
                     if m not in declared and re.sub(r"_(total|bucket|count|sum)$", "", m) not in declared)
    assert not unknown, unknown


def test_the_remote_sweepers_gauges_render_with_a_namespace_and_refuse_an_undeclared_key():
    from sparkcache.metrics import REMOTE_GC_GAUGES, render_remote_gc_gauges

    assert all(g.name.startswith("remote_gc_") and not g.per_rank for g in REMOTE_GC_GAUGES)
    text = render_remote_gc_gauges({"ok": 1, "used_bytes_after": 5}, "prod")
    assert 'vllm:sparkcache_remote_gc_last_pass_ok{namespace="prod"} 1.0' in text
    assert 'vllm:sparkcache_remote_gc_used_bytes{namespace="prod"} 5.0' in text
    with pytest.raises(UndeclaredMetric, match="REMOTE_GC_GAUGES"):
        render_remote_gc_gauges({"used_bites": 5}, "prod")
