"""``vllm serve`` (OpenAI server, CPU, tiny offline model) with sparkcache in read-write.

A 6-turn growing chat through ``/v1/chat/completions`` (greedy, small ``max_tokens``;
the tiny model's tokenizer has a chat template, passed again with ``--chat-template`` from a
file in the test's tmp dir). For every response:

- ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``) equals
  the attribution record's ``local_hit_tokens + external_tokens``; in one server life the
  store never holds more than the local prefix cache, so ``external_tokens == 0`` and the
  cached tokens are exactly the local hit;
- the record comes back in the response's ``kv_transfer_params["sparkcache"]`` and sums to
  ``usage.prompt_tokens``; the same record is in the server's output as the
  ``sparkcache-attribution {json}`` log line (engine-core process).

After the last turn, on the idle server, ``GET /metrics`` (parsed with
``prometheus_client.parser``) shows ``vllm:sparkcache_attributed_tokens_total{source}`` equal
to the sums of the six records, ``attributed_requests_total{complete="true"}`` = 6, every
planned capture settled (queued = published + publish_failed, nothing pending), and the
gauges equal to the store on disk read after the run (``capacity_used_bytes`` = its
allocated bytes, ``entries`` = its entry count, ``capacity_limit_bytes``,
``capture_slots_total``). The connector keeps vLLM stepping until its last capture settled
(``has_pending_push_work``), so these numbers arrive without another request; the test
waits for the frontend to receive them and then checks that they stay put.

The server runs in its own process group (engine processes ignore SIGTERM) which the
fixture kills with SIGKILL in teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
TURNS = 6
MAX_TOKENS = 8
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
WORDS = ("the cache holds a prefix of every prompt and the model reads it back when a new turn "
         "of the same conversation arrives so only the new words are computed again by the engine "
         "while the store keeps pages on disk").split()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


@contextlib.contextmanager
def serve(model: str, tmp: Path, root: Path, *, block_size: int = BLOCK,
          extra_args: tuple[str, ...] = (), port: int | None = None, extra_config: dict | None = None):
    """One ``vllm serve`` life on 127.0.0.1 (``port``, or a free one) with sparkcache
    read-write on ``root`` (plus ``extra_config`` settings); yields ``{"base", "root", "log"}``
    once healthy, kills its process group afterwards."""
    template = tmp / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    port = port or _free_port()
    kvt = {"kv_connector": "SparkcacheConnector", "kv_connector_module_path": "sparkcache.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"root": str(root), "access_mode": "read-write",
                                         "min_span_tokens": 64, **(extra_config or {})}}
    # ``vllm serve`` is ``vllm.entrypoints.cli.main``, which needs vLLM's package metadata
    # (absent in this venv's build) only for its --version string; the server it starts is
    # this module's, so run that directly with the same arguments.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--block-size", str(block_size), "--max-model-len", "4096",
           "--enable-prefix-caching", "--seed", "0",
           "--enable-prompt-tokens-details", "--chat-template", str(template),
           "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(kvt), *extra_args]
    if "--max-num-batched-tokens" not in extra_args:
        cmd += ["--max-num-batched-tokens", "4096"]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO), NO_PROXY="127.0.0.1",
               no_proxy="127.0.0.1")
    log_path = tmp / f"server-{port}.log"
    log = open(log_path, "w+")
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if p.poll() is not None:
                raise AssertionError(f"vllm serve exited rc={p.returncode}:\n{log_path.read_text()[-8000:]}")
            try:
                if _get(base + "/health", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not healthy in time:\n{log_path.read_text()[-8000:]}")
            time.sleep(1.0)
        yield {"base": base, "root": root, "log": log_path}
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        log.close()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    with serve(tiny_model, tmp, tmp / "store") as srv:
        yield srv


def _user_message(turn: int) -> str:
    rng = random.Random(turn)
    return " ".join(rng.choice(WORDS) for _ in range(60 + 10 * turn))


def converse(base: str, messages: list[dict], turns: range) -> list[dict]:
    """Greedy chat turns through ``/v1/chat/completions``; ``messages`` grows in place."""
    out = []
    for turn in turns:
        messages.append({"role": "user", "content": _user_message(turn)})
        resp = _post(base + "/v1/chat/completions",
                     {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS,
                      "temperature": 0.0, "ignore_eos": True})
        out.append(resp)
        messages.append({"role": "assistant", "content": resp["choices"][0]["message"]["content"] or ""})
    return out


def settled_metrics(base: str, requests: int) -> tuple[dict, dict]:
    """``/metrics`` once every planned capture settled at the frontend (the last steps' stats
    arrive asynchronously), and again 2 s later (an idle server's numbers stay put)."""
    deadline, samples = time.monotonic() + 300, {}  # a disk behind another job's writes is slow
    while True:
        samples = _samples(_get(base + "/metrics")[1])
        queued, skipped, done = (sum(_value(samples, "vllm:sparkcache_captures_total", outcome=o) for o in outcomes)
                                 for outcomes in (("queued",), ("skipped_slots_full", "skipped_too_large"),
                                                  ("published", "publish_failed")))
        if (_value(samples, "vllm:sparkcache_attributed_requests_total") >= requests and queued + skipped > 0
                and done >= queued and _value(samples, "vllm:sparkcache_publication_pending_slots") == 0
                and _value(samples, "vllm:sparkcache_captures_unsettled") == 0):
            break
        if time.monotonic() > deadline:  # a server killed now would lose what is still pending
            raise AssertionError("the captures did not settle: " + str(
                {k: v for k, v in samples.items() if "captures" in k[0] or "pending" in k[0]}))
        time.sleep(0.5)
    time.sleep(2.0)
    return samples, _samples(_get(base + "/metrics")[1])


@pytest.fixture(scope="module")
def chat(server):
    messages: list[dict] = [{"role": "system", "content": "you answer briefly"}]
    turns = converse(server["base"], messages, range(TURNS))
    samples, settled = settled_metrics(server["base"], TURNS)
    return {"turns": turns, "metrics": samples, "metrics_later": settled, "log": server["log"],
            "root": server["root"]}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels without vLLM's engine/model_name): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``; NaN when absent."""
    hits = [v for (n, lab), v in samples.items()
            if n == name and all(dict(lab).get(k) == want for k, want in labels.items())]
    return sum(hits) if hits else float("nan")


def _record(resp: dict) -> dict:
    ktp = resp.get("kv_transfer_params") or {}
    assert "sparkcache" in ktp, f"no attribution record in the response: {resp}"
    return ktp["sparkcache"]


def test_each_turn_cached_tokens_match_the_attribution_record(chat):
    hits = []
    for i, resp in enumerate(chat["turns"]):
        usage = resp["usage"]
        rec = _record(resp)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        assert cached is not None, f"turn {i}: no prompt_tokens_details.cached_tokens: {usage}"
        assert rec["complete"] and rec["reason"] == "ok", rec
        assert rec["prompt_tokens"] == usage["prompt_tokens"], (i, rec, usage)
        assert rec["local_hit_tokens"] + rec["external_tokens"] + rec["recomputed_tokens"] == rec["prompt_tokens"]
        assert rec["external_tokens"] == 0, (i, rec)  # one server life: the store adds nothing
        assert cached == rec["local_hit_tokens"], (i, cached, rec)
        hits.append(cached)
        print(f"turn {i}: prompt={usage['prompt_tokens']} cached={cached} record={rec}")
    assert hits[0] == 0
    assert all(h > 0 and h % BLOCK == 0 for h in hits[1:]), hits  # the growing chat hits locally
    assert hits == sorted(hits), hits


def test_attribution_log_lines_match_the_responses(chat):
    lines = [json.loads(line.split("sparkcache-attribution ", 1)[1])
             for line in chat["log"].read_text().splitlines() if "sparkcache-attribution {" in line]
    assert lines, "no sparkcache-attribution log line in the server's output"
    by_id = {r["request_id"]: r for r in lines}
    for resp in chat["turns"]:
        rec = _record(resp)
        assert by_id.get(rec["request_id"]) == rec



def _store_capacity(root):
    """The store as a separate reader sees it after the run (never recovers or writes)."""
    from sparkcache.settings import load_settings
    from sparkcache.store import PageStore

    return PageStore.from_settings(load_settings(extra_config={"root": str(root)}), read_only=True).capacity()


def test_metrics_on_the_idle_server_match_the_records_and_the_store(chat):
    m = chat["metrics"]
    records = [_record(resp) for resp in chat["turns"]]
    for source, key in (("local_hit", "local_hit_tokens"), ("external", "external_tokens"),
                        ("recomputed", "recomputed_tokens")):
        got = _value(m, "vllm:sparkcache_attributed_tokens_total", source=source)
        assert got == sum(r[key] for r in records), (source, got, records)
    assert _value(m, "vllm:sparkcache_attributed_requests_total", complete="true") == TURNS
    assert _value(m, "vllm:sparkcache_attributed_requests_total", complete="false") == 0
    queued = _value(m, "vllm:sparkcache_captures_total", outcome="queued")
    published = _value(m, "vllm:sparkcache_captures_total", outcome="published")
    failed = _value(m, "vllm:sparkcache_captures_total", outcome="publish_failed")
    assert queued >= 1 and published + failed == queued, (queued, published, failed)
    # one latency sample per publication, one size sample per published shard
    assert _value(m, "vllm:sparkcache_publication_seconds_count") == published + failed
    assert _value(m, "vllm:sparkcache_publication_bytes_count") == published
    assert _value(m, "vllm:sparkcache_restore_seconds_count") == 0  # one life: nothing restored
    # what the connector adds to a step, one sample per engine step on each side: a turn
    # takes at least a step per output token
    for side in ("worker", "scheduler"):
        assert _value(m, f"vllm:sparkcache_{side}_step_seconds_count") >= TURNS * MAX_TOKENS, side
    assert _value(m, "vllm:sparkcache_filesystem_free_bytes") > 0
    assert _value(m, "vllm:sparkcache_publication_pending_slots") == 0
    # the workers' settle reports reached the scheduler (else it waits 120 s for them)
    assert _value(m, "vllm:sparkcache_captures_unsettled") == 0
    assert _value(m, "vllm:sparkcache_publication_pending_bytes") == 0
    cap = _store_capacity(chat["root"])
    print(f"metrics: attributed={[_value(m, 'vllm:sparkcache_attributed_tokens_total', source=s) for s in ('local_hit', 'external', 'recomputed')]} "
          f"captures queued={queued} published={published} used_bytes={_value(m, 'vllm:sparkcache_capacity_used_bytes')} "
          f"entries={_value(m, 'vllm:sparkcache_entries')}; store: {cap}")
    assert cap.entries >= 1 and cap.used_bytes > 0
    assert _value(m, "vllm:sparkcache_capacity_used_bytes") == cap.used_bytes
    assert _value(m, "vllm:sparkcache_entries") == cap.entries
    assert _value(m, "vllm:sparkcache_capacity_limit_bytes") == cap.max_bytes
    from sparkcache.settings import load_settings

    assert _value(m, "vllm:sparkcache_capture_slots_total") == load_settings(extra_config={"root": str(chat["root"])}).capture_slots


def test_metrics_stay_put_on_the_idle_server(chat):
    names = [k for k in chat["metrics"] if k[0].startswith("vllm:sparkcache_")
             and "oldest_pending_age" not in k[0] and not k[0].endswith("_created")]
    assert names
    assert {k: chat["metrics"][k] for k in names} == {k: chat["metrics_later"].get(k) for k in names}
