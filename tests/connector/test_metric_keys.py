"""One metrics path: every data key the connector emits is declared in ``sparkcache/metrics.py``,
every declared key is emitted, vLLM's stats refuse an undeclared one, and vLLM's
``/metrics`` and ``sparkcache status`` export the declarations under the same names.

The source scan reads ``sparkcache/`` (ast) for every call that emits a key: a counter
(``counters.add``, ``stats.add``, ``_add``, ``add_count``), a histogram sample
(``samples.add``, ``stats.observe``), an engine gauge (``set_gauge``), a rank gauge
(``set_rank_gauge``, ``gauges.update(key=...)``, ``gauges["key"] = ...``), or the checks
themselves (``require_*``). A literal key (or each branch of ``a if c else b``) must be
declared; ``"prefix_" + reason`` must prefix declared keys; anything else must be one of
the forwarding sites listed here (they pass on keys emitted elsewhere).

Real parts: vLLM 0.32.0's ``KVConnectorProm`` (the frontend's hook, which asks the connector
class vLLM loads for its metrics) on prometheus_client's classes in a private registry, the
connector's scheduler half on vLLM's real Scheduler, its worker half on a real store.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest

from sparkcache.store.remote_counts import COUNT_KEYS as TIER_KEYS
from sparkcache.metrics import (COUNTERS, ENGINE_GAUGE_KEYS, GAUGES, HISTOGRAM_KEYS, HISTOGRAMS,
                                PREFIX, RANK_GAUGE_KEYS, COUNTER_KEYS, UndeclaredMetric,
                                render_store_gauges, store_gauges)

from .conftest import REPO

PRODUCT = REPO / "sparkcache"
KINDS = {"counter": COUNTER_KEYS, "histogram": HISTOGRAM_KEYS, "gauge": ENGINE_GAUGE_KEYS,
         "rank_gauge": RANK_GAUGE_KEYS}
# method or function -> (index of the key argument, kind, receivers it counts on; None: any)
SINKS = {
    "add": (0, None, {"counters": "counter", "stats": "counter", "samples": "histogram"}),
    "_add": (0, "counter", None),
    "add_count": (1, "counter", None),
    "require_counter": (0, "counter", None),
    "observe": (0, "histogram", {"stats"}),
    "require_histogram": (0, "histogram", None),
    # require_gauge(key, per_rank=...): a rank gauge or the engine's, by its per_rank
    "set_gauge": (0, "gauge", None),
    "set_rank_gauge": (1, "rank_gauge", None),
}
GAUGE_DICTS = {"gauges", "_gauges"}  # a worker's rank gauges, by data key
# Where a key is a variable: these pass on keys emitted (and checked) elsewhere.
FORWARDERS = {
    "sparkcache/connector/stats.py:SparkcacheStats.aggregate",   # another process's stats
    "sparkcache/connector/stats.py:SparkcacheStats.add",          # the checks themselves
    "sparkcache/connector/stats.py:SparkcacheStats.observe",
    "sparkcache/connector/stats.py:SparkcacheStats.set_gauge",
    "sparkcache/connector/stats.py:SparkcacheStats.set_rank_gauge",
    "sparkcache/connector/connector.py:SparkcacheConnector._take_stats",  # both halves' numbers
    "sparkcache/connector/samples.py:Samples.add",
    "sparkcache/connector/samples.py:add_count",
    "sparkcache/connector/scheduler_side.py:SchedulerCounters.add",
    "sparkcache/connector/scheduler_side.py:SchedulerSide._take_remote_counts",  # the shared tier's
    "sparkcache/connector/worker_side.py:WorkerSide._add",
    "sparkcache/connector/worker_side.py:WorkerSide.take_stats",  # store_gauges' and maintenance's
    "sparkcache/metrics.py:render_store_gauges",                  # store_gauges' keys
}


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _keys_of(expr: ast.AST) -> list[tuple[str, str]]:
    """("key", k), ("prefix", p) or ("dynamic", source) for each key ``expr`` can be."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [("key", expr.value)]
    if isinstance(expr, ast.IfExp):
        return _keys_of(expr.body) + _keys_of(expr.orelse)
    if (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add) and isinstance(expr.left, ast.Constant)
            and isinstance(expr.left.value, str)):
        return [("prefix", expr.left.value)]
    if isinstance(expr, ast.JoinedStr) and expr.values and isinstance(expr.values[0], ast.Constant):
        return [("prefix", expr.values[0].value)]
    return [("dynamic", ast.unparse(expr))]


class _Emissions(ast.NodeVisitor):
    """(kind, form, key, where) of every emission in one module; where = path:Class.function."""

    def __init__(self, path: str) -> None:
        self.path, self.scope, self.found = path, [], []

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def _where(self) -> str:
        return f"{self.path}:{'.'.join(self.scope)}"

    def _add(self, kind: str, expr: ast.AST) -> None:
        self.found += [(kind, form, key, self._where()) for form, key in _keys_of(expr)]

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        method = _name(func)
        if method == "require_gauge" and node.args:
            per_rank = next((kw.value for kw in node.keywords if kw.arg == "per_rank"), None)
            if isinstance(per_rank, ast.Constant):
                self._add("rank_gauge" if per_rank.value else "gauge", node.args[0])
            else:
                self.found.append(("gauge", "dynamic", ast.unparse(node), self._where()))
        if method in SINKS:
            index, kind, receivers = SINKS[method]
            receiver = _name(func.value) if isinstance(func, ast.Attribute) else None
            if isinstance(receivers, dict):
                kind = receivers.get(receiver)
            elif receivers is not None and receiver not in receivers:
                kind = None
            if kind is not None and len(node.args) > index:
                self._add(kind, node.args[index])
        if (method == "update" and isinstance(func, ast.Attribute) and _name(func.value) in GAUGE_DICTS):
            for kw in node.keywords:
                self.found.append(("rank_gauge", "key", kw.arg, self._where()))
            for arg in node.args:
                self._add("rank_gauge", arg)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Subscript) and _name(target.value) in GAUGE_DICTS:
                self._add("rank_gauge", target.slice)
        self.generic_visit(node)


def emissions(source: str, path: str) -> list[tuple[str, str, str, str]]:
    visitor = _Emissions(path)
    visitor.visit(ast.parse(source))
    return visitor.found


@functools.cache
def product_emissions() -> tuple[tuple[str, str, str, str], ...]:
    out = []
    for path in sorted(PRODUCT.rglob("*.py")):
        out += emissions(path.read_text(), str(path.relative_to(REPO)))
    return tuple(out)


# ---------------------------------------------------------------------- the source scan


def test_every_key_the_product_emits_is_declared():
    found = product_emissions()
    undeclared = [(kind, key, where) for kind, form, key, where in found
                  if form == "key" and key not in KINDS[kind]]
    assert not undeclared, ("emitted but not declared in sparkcache/metrics.py", undeclared)
    unprefixed = [(kind, key, where) for kind, form, key, where in found
                  if form == "prefix" and not any(k.startswith(key) for k in KINDS[kind])]
    assert not unprefixed, ("a prefix no declared key has", unprefixed)
    dynamic = {where for _, form, _, where in found if form == "dynamic"}
    assert dynamic == FORWARDERS, ("a key that is neither a literal nor a declared prefix: emit a "
                                   "literal, or list a site that only passes keys on",
                                   sorted(dynamic ^ FORWARDERS))


def test_every_declared_key_is_emitted_somewhere():
    """The shared tier's keys are emitted by its ``RemoteCounts`` (which refuses any other key),
    whose drains both halves forward."""
    found = product_emissions()
    for kind, declared in KINDS.items():
        literal = {key for k, form, key, _ in found if k == kind and form == "key"}
        if kind == "counter":
            literal |= TIER_KEYS
        prefixes = {key for k, form, key, _ in found if k == kind and form == "prefix"}
        dead = sorted(key for key in declared if key not in literal and not any(key.startswith(p) for p in prefixes))
        assert not dead, (f"{kind} data keys declared but never emitted: remove them or emit them", dead)


def test_the_scan_sees_each_way_a_key_is_emitted():
    """The scan itself (so the tests above can fail): each form is found with its kind."""
    source = (
        "class W:\n"
        "    def f(self, stats, samples, gauges, counters, r, rank, kv):\n"
        "        self.counters.add('c_literal')\n"
        "        counters.add('c_a' if r else 'c_b', 2)\n"
        "        stats.add('skipped_' + r)\n"
        "        self._add(f'lookup_miss_{r}')\n"
        "        add_count(counters, 'c_fn', 1)\n"
        "        self.samples.add('h_literal', 0.1)\n"
        "        stats.observe('h_obs', [1.0])\n"
        "        stats.set_gauge('g_engine', 1)\n"
        "        stats.set_rank_gauge(rank, 'g_rank', 1)\n"
        "        gauges.update(g_kw=1)\n"
        "        self._gauges['g_item'] = 1\n"
        "        require_gauge('g_checked', per_rank=False)\n"
        "        stats.add(r)\n"
        "        self.finished.add('not-a-key')\n"
        "        child.observe(0.5)\n")
    got = {(kind, form, key) for kind, form, key, _ in emissions(source, "x.py")}
    assert got == {("counter", "key", "c_literal"), ("counter", "key", "c_a"), ("counter", "key", "c_b"),
                   ("counter", "prefix", "skipped_"), ("counter", "prefix", "lookup_miss_"),
                   ("counter", "key", "c_fn"), ("histogram", "key", "h_literal"),
                   ("histogram", "key", "h_obs"), ("gauge", "key", "g_engine"),
                   ("rank_gauge", "key", "g_rank"), ("rank_gauge", "key", "g_kw"),
                   ("rank_gauge", "key", "g_item"), ("gauge", "key", "g_checked"),
                   ("counter", "dynamic", "r")}, got
    assert {where for *_, where in emissions(source, "x.py")} == {"x.py:W.f"}


# ---------------------------------------------------------------------- vLLM's stats


@pytest.mark.parametrize("emit, key", [
    (lambda s: s.add("restores_maybe"), "restores_maybe"),
    (lambda s: s.add("restores_maybe", 0), "restores_maybe"),  # refused even when nothing is added
    (lambda s: s.set_gauge("used_bytes", 1), "used_bytes"),    # a rank gauge set as the engine's
    (lambda s: s.set_rank_gauge(0, "pending_frees", 1), "pending_frees"),
    (lambda s: s.observe("restore_secs", [0.1]), "restore_secs"),
    (lambda s: s.aggregate(type(s)(data={"counters": {"nope": 1}})), "nope"),
], ids=["add", "add_nothing", "engine_gauge", "rank_gauge", "observe", "aggregate"])
def test_vllm_stats_refuse_an_undeclared_key(emit, key):
    from sparkcache.connector.stats import SparkcacheStats

    stats = SparkcacheStats()
    with pytest.raises(UndeclaredMetric, match=rf"'{key}' is not declared.*sparkcache/metrics.py"):
        emit(stats)
    assert stats.is_empty()


def _frontend_metrics():
    """vLLM's frontend hook (``KVConnectorProm``) for a config that loads the connector, on
    prometheus_client's classes in a private registry (vLLM's own logger subclasses it the
    same way); the registry."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="SparkcacheConnector", kv_connector_module_path="sparkcache.connector", kv_role="kv_both"))
    return Prom(config, ["model_name", "engine"], {0: ["tiny", "0"]}), registry


def test_vllm_exports_exactly_the_declarations_with_the_shipped_values(tmp_path):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sparkcache.connector.stats import SparkcacheStats

    prom, registry = _frontend_metrics()
    worker, scheduler = SparkcacheStats(), SparkcacheStats()
    worker.add("restored_page_bytes", 4096)
    worker.add("lookup_miss_corrupt")
    worker.set_rank_gauge(1, "used_bytes", 12345)
    worker.observe("restore_seconds", [0.02, 0.03])
    scheduler.add("restores_failed")
    scheduler.set_gauge("pending_block_frees", 2)
    prom.observe(scheduler.aggregate(worker).data, engine_idx=0)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
                if not f.name.endswith("_created")}  # prometheus_client's creation times
    assert set(families) == {PREFIX + m.name for m in (*COUNTERS, *GAUGES, *HISTOGRAMS)}

    def value(name, suffix="", **labels):
        return sum(s.value for s in families[PREFIX + name].samples
                   if s.name == PREFIX + name + suffix and labels.items() <= s.labels.items())

    assert value("restored_bytes", "_total", kind="page", engine="0") == 4096
    assert value("lookup_misses", "_total", reason="corrupt") == 1
    assert value("lookup_misses", "_total", reason="not_found") == 0
    assert value("restores", "_total", outcome="refused") == 1 == value("load_failures", "_total")
    assert value("capacity_used_bytes", rank="1", model_name="tiny") == 12345
    assert value("pending_block_frees") == 2
    assert value("restore_seconds", "_count") == 2
    # the CLI's text: the same names and help, with the rank label and no engine labels
    store_text = render_store_gauges([{"used_bytes": 1, "entries": 2}])
    for family in text_string_to_metric_families(store_text):
        assert family.name in families and family.documentation == families[family.name].documentation
        assert all(set(s.labels) == {"rank"} for s in family.samples)


# ---------------------------------------------------------------------- lookup misses by reason


def test_the_scheduler_counts_a_lookup_that_found_nothing(tmp_path):
    from .scheduler_scenarios import finish_all, make_scheduler, request
    from .test_input_kinds_scheduler import _counted, _prompt

    s = make_scheduler(str(tmp_path), hybrid=False)
    counters = _counted(s)
    s.add_request(request("cold", _prompt(7)))
    finish_all(s)
    assert counters.get("lookup_miss_not_found", 0) >= 1, counters
    assert not any(k.startswith("lookup_miss_") and k != "lookup_miss_not_found" for k in counters)


def test_a_worker_counts_its_failed_page_reads_by_reason(tmp_path):
    from .test_worker_restore import STORED_BLOCKS, _captured, _cleared_destination, _plan
    from .test_worker_maintenance import _worker

    worker = _worker(tmp_path / "store", "read-write")
    try:
        keys, _ = _captured(worker, STORED_BLOCKS)
        plan = _plan(worker, keys, 0, _cleared_destination(worker, 0))
        os.unlink(worker.store.objects.path(plan.stored.pages[1].digest))  # evicted meanwhile
        worker.load(plan)
        assert worker.take_results()[1:] == ({"r"}, {"r"})
        counters, gauges = worker.take_stats(0.0)
        assert counters.get("lookup_miss_absent") == 1, counters
        # what a worker ships with its stats is what vLLM's stats take
        from sparkcache.connector.stats import SparkcacheStats

        shipped = SparkcacheStats()
        for k, v in counters.items():
            shipped.add(k, v)
        for k, v in gauges.items():
            shipped.set_rank_gauge(0, k, v)
        assert set(store_gauges(worker.store)) <= set(gauges)
    finally:
        worker.close()
