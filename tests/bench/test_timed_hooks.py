"""``bench.timed_hooks``: the restore arms' own connectors with their load hooks timed. vLLM's
factory must find each timed name and get the arm's connector back, changed in nothing but the
timed hooks; a timed hook returns and raises what the hook does; the log counts every line of
every process, and none twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import timed_hooks
from bench.timed_hooks import HOOKS, LOG_ENV, HookLog

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["TimedSparkcacheConnector", "TimedExampleConnector"])
def test_vllm_finds_each_timed_connector_and_it_is_the_arms_own_with_its_hooks_timed(name):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    found = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector=name, kv_connector_module_path="bench.timed_hooks", kv_role="kv_both"))
    module, own = timed_hooks.TIMED[name]
    arms = getattr(__import__(module, fromlist=[own]), own)
    assert found.__mro__[1] is arms
    assert {k for k in vars(found) if not k.startswith("_")} == set(HOOKS)  # beside ABC's and type's own
    for hook in HOOKS:
        assert getattr(found, hook) is not getattr(arms, hook)
        assert getattr(found, hook).__name__ == hook
    with pytest.raises(AttributeError, match="timed connectors: "):
        timed_hooks.TimedNoSuchConnector  # noqa: B018


class _Hooks:
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return request * 2, num_computed_tokens

    def update_state_after_alloc(self, *args):
        raise ValueError("from the hook")

    def build_connector_meta(self, scheduler_output):
        time.sleep(0.05)
        return scheduler_output

    def start_load_kv(self, forward_context, **kwargs):
        return kwargs


def test_a_timed_hook_returns_and_raises_what_the_hook_does_and_records_each_call(tmp_path, monkeypatch):
    log = HookLog(str(tmp_path / "hooks"))
    monkeypatch.setenv(LOG_ENV, log.path)
    monkeypatch.setattr(timed_hooks, "_fd", [])  # this process's descriptor, opened on the first call
    hooks = timed_hooks.timed(_Hooks)()
    assert log.take() == dict.fromkeys(HOOKS, 0.0)  # nothing written yet
    assert hooks.get_num_new_matched_tokens(21, num_computed_tokens=5) == (42, 5)
    assert hooks.start_load_kv(None, layer="x") == {"layer": "x"}
    assert hooks.build_connector_meta("meta") == "meta"
    with pytest.raises(ValueError, match="from the hook"):
        hooks.update_state_after_alloc(1, 2, 3)
    took = log.take()
    assert all(took[hook] > 0 for hook in HOOKS)
    assert 0.05 <= took["build_connector_meta"] < 5  # the hook's own time, in seconds
    assert log.take() == dict.fromkeys(HOOKS, 0.0)  # counted once
    os.close(timed_hooks._fd[0])


def test_a_log_beside_a_root_not_made_yet_records_the_first_hook(tmp_path, monkeypatch):
    # bench.corruption's roots (work/<arm>/<variant>) and ExampleConnector's storage path are
    # made by the life, not before it; the log beside the root must take the first line anyway
    log = HookLog(str(tmp_path / "example" / "stored.hooks-1"))
    monkeypatch.setenv(LOG_ENV, log.path)
    monkeypatch.setattr(timed_hooks, "_fd", [])
    assert timed_hooks.timed(_Hooks)().start_load_kv(None) == {}
    assert log.take()["start_load_kv"] > 0
    os.close(timed_hooks._fd[0])


def test_outside_a_bench_life_a_timed_hook_records_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(LOG_ENV, raising=False)
    monkeypatch.setattr(timed_hooks, "_fd", [])
    assert timed_hooks.timed(_Hooks)().build_connector_meta("meta") == "meta"
    assert timed_hooks._fd == []


_WRITER = """import sys
from bench import timed_hooks
for _ in range(int(sys.argv[1])):
    timed_hooks._record(sys.argv[2], 0.001)"""


def test_the_log_counts_every_line_of_two_processes_and_a_line_being_written_waits(tmp_path):
    log = HookLog(str(tmp_path / "hooks"))
    env = {**os.environ, LOG_ENV: log.path}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, "2000", hook], cwd=REPO, env=env)
               for hook in ("start_load_kv", "get_num_new_matched_tokens")]
    taken = []
    while any(w.poll() is None for w in writers):  # read while they write
        taken.append(log.take())
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    with open(log.path, "ab") as f:
        f.write(b"start_load_kv 7")  # a line not yet whole
    taken.append(log.take())
    total = {hook: sum(t[hook] for t in taken) for hook in HOOKS}
    assert total["start_load_kv"] == pytest.approx(2.0) and total["get_num_new_matched_tokens"] == pytest.approx(2.0)
    with open(log.path, "ab") as f:
        f.write(b".5\n")
    assert log.take()["start_load_kv"] == pytest.approx(7.5)
