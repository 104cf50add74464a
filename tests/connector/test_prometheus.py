"""The dashboard and the alert rules of ``docs/monitoring`` against a real Prometheus.

Debian's Prometheus on 127.0.0.1 scrapes ``vllm serve`` (tiny Llama, sparkcache read-write,
its root on a 64 MiB tmpfs with ``min_free_bytes`` 8 MiB) every second and evaluates the rule
file every second. A chat of three turns, a restart on the same port (the target stays), and
three more turns with two faults injected into the second life:

- before it starts, one byte of every stored object flipped: turn 4's restore is refused,
  its objects quarantined and vLLM recomputes;
- after turn 4, another tenant fills the volume below the floor: turns 5 and 6's
  publications are refused (``low_free_space``) and maintenance empties the store (the
  floor cannot be met by evicting).

Then, with the server still up (a stopped target's series go stale), every dashboard
expression returns series through Prometheus's HTTP API, evaluating every alert expression
finds exactly the alerts of those faults true, and Prometheus's own rule evaluation has
exactly those alerts active (firing, or pending while their ``for`` runs). ``promtool check rules`` passes and
Prometheus loaded every rule healthy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, flip_byte
from .test_serve_chat import _free_port, _get, converse, serve, settled_metrics

pytestmark = [pytest.mark.engine, pytest.mark.root, pytest.mark.slow]

DOCS = REPO / "docs" / "monitoring"
RULES = DOCS / "sparkcache-alerts.yaml"
DASHBOARD = DOCS / "sparkcache-dashboard.json"
FLOOR = 8 << 20
# what the injected faults must set off, and nothing else
FIRING = {"SparkcacheRestoresRefused", "SparkcacheCorruptObjects", "SparkcacheLowFreeSpace"}


def _query(prom: str, expr: str) -> list[dict]:
    status, body = _get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10)
    reply = json.loads(body)
    assert status == 200 and reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$model", ".*") for p in dash["panels"] for t in p["targets"]]


def _alert_rules() -> dict[str, str]:
    rules = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}


def _tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    # Not a skip: CI treats a skip as a failure, and this test is required.
    assert proc.returncode == 0, ("cannot mount a tmpfs (run as root, or in a container with "
                                  f"CAP_SYS_ADMIN): {proc.stderr.strip()}")


def _start_prometheus(tmp: Path, target_port: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
    }))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-4000:]
        try:
            if _get(base + "/-/ready", timeout=2)[0] == 200:
                return proc, base
        except OSError:
            pass
        assert time.monotonic() < deadline, "Prometheus not ready in 60 s"
        time.sleep(0.5)


def _flip_every_object(root: Path) -> int:
    n = 0
    for path in (root / "default" / "objects").rglob("*"):
        if path.is_file():
            flip_byte(path)
            n += 1
    return n


def _wait_for(prom: str, expr: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _query(prom, expr):
        assert time.monotonic() < deadline, f"Prometheus never saw {expr}"
        time.sleep(1.0)


@pytest.fixture(scope="module")
def monitored(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    volume = tmp / "volume"
    _tmpfs(volume, "64m")
    root = volume / "store"
    port = _free_port()
    prom_proc = None
    messages: list[dict] = [{"role": "system", "content": "you answer briefly"}]
    extra = {"min_free_bytes": str(FLOOR)}
    out = {}
    try:
        prom_proc, prom = _start_prometheus(tmp, port)
        with serve(tiny_model, tmp, root, port=port, extra_config=extra) as srv:
            out["first"] = converse(srv["base"], messages, range(0, 3))
            settled_metrics(srv["base"], 3)
            _wait_for(prom, "vllm:sparkcache_publication_seconds_count > 0")
        out["flipped"] = _flip_every_object(root)
        with serve(tiny_model, tmp, root, port=port, extra_config=extra) as srv:
            out["second"] = converse(srv["base"], messages, range(3, 4))
            free = os.statvfs(volume).f_bavail * os.statvfs(volume).f_frsize
            with open(volume / "other-tenant", "wb") as f:  # 4 MiB under the floor left free
                f.write(b"\0" * (free - FLOOR + (4 << 20)))
            out["second"] += converse(srv["base"], messages, range(4, 6))
            settled_metrics(srv["base"], 3)
            _wait_for(prom, 'vllm:sparkcache_publish_failures_total{reason="low_free_space"} > 0')
            _wait_for(prom, 'vllm:sparkcache_restores_total{outcome="refused"} > 0')
            time.sleep(3)  # a few more scrapes and rule evaluations
            out["dashboard"] = {expr: _query(prom, expr) for expr in _dashboard_exprs()}
            out["alerts"] = {name: _query(prom, expr) for name, expr in _alert_rules().items()}
            out["rules"] = json.loads(_get(prom + "/api/v1/rules")[1])["data"]["groups"]
            # Prometheus's own evaluation: pending while a rule's ``for`` runs, then firing
            out["active"] = json.loads(_get(prom + "/api/v1/alerts")[1])["data"]["alerts"]
    finally:
        if prom_proc is not None:
            try:
                os.killpg(prom_proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            prom_proc.wait(timeout=30)
        subprocess.run(["umount", "-l", str(volume)], check=False)
    return out


def test_promtool_accepts_the_rules():
    proc = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in proc.stdout


def test_the_faults_happened_as_injected(monitored):
    assert monitored["flipped"] > 0
    turn4 = monitored["second"][0]["kv_transfer_params"]["sparkcache"]
    assert turn4["failed_restores"] == 1 and turn4["external_tokens"] == 0


def test_every_dashboard_expression_returns_series(monitored):
    # series exist: a misspelled metric or label, or a metric the connector stopped
    # exporting, returns none (values are the engine tests' business)
    empty = [expr for expr, result in monitored["dashboard"].items() if not result]
    assert not empty, empty
    assert len(monitored["dashboard"]) == len(_dashboard_exprs()) >= 20


def test_exactly_the_alerts_of_the_injected_faults_fire(monitored):
    firing = {name for name, result in monitored["alerts"].items() if result}
    assert firing == FIRING, firing
    active = {a["labels"]["alertname"]: a["state"] for a in monitored["active"]}
    assert set(active) == FIRING, active
    # no ``for``: firing at once; the free-space alert waits 5 minutes under the floor first
    assert active["SparkcacheRestoresRefused"] == active["SparkcacheCorruptObjects"] == "firing"
    assert active["SparkcacheLowFreeSpace"] == "pending"
    rules = [r for g in monitored["rules"] for r in g["rules"]]
    assert len(rules) == len(_alert_rules()) and all(r["health"] == "ok" for r in rules), rules
