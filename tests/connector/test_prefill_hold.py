"""Background work holds still while the model prefills (``prefill_hold.py``): the model's
thread, the publisher and the maintenance thread share one interpreter lock (and, on a
machine of two cores, the cores), and a prefill is what a waiting user's first token waits
on. A step that prefills holds publication and maintenance until its first token is out (the
next step starts without prefilling, or ``tail_s`` after its forward), for at most ``max_s``;
a decode step holds nothing.

Real parts: vLLM's Scheduler with sparkcache's scheduler half (what a step's metadata says),
sparkcache's worker half capturing out of vLLM's own CPU KV layout into its store on disk."""

from __future__ import annotations

import contextlib
import threading
import time

from sparkcache.connector.capture_plans import CapturePlan
from sparkcache.connector.prefill_hold import PrefillHold, prefill_tokens

from testing.vllm_kv_caches import vllm_kv_caches
from testing.vllm_scheduler import step

from .scheduler_scenarios import make_scheduler, request
from .test_streamed_capture import _keys, _wait, _worker


def _waiter(hold: PrefillHold) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def run() -> None:
        t = time.monotonic()
        hold.wait()
        took.append(time.monotonic() - t)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, took


def test_a_prefill_step_holds_the_publisher_until_the_next_step_starts_without_prefilling():
    hold = PrefillHold(max_s=30, tail_s=30)
    hold.step(0)  # a decode step: nothing held
    thread, took = _waiter(hold)
    thread.join(5)
    assert took and took[0] < 1
    hold.step(255)
    thread, took = _waiter(hold)
    thread.join(0.2)
    assert thread.is_alive() and not took, "the publisher went on while the step prefilled"
    hold.step_done()
    thread.join(0.2)
    assert thread.is_alive() and not took, "the publisher went on before the first token was out"
    hold.step(7)  # the next step prefills too (another request's chunk): still held
    hold.step_done()
    thread.join(0.2)
    assert thread.is_alive() and not took
    hold.step(0)  # a step that only decodes: the first tokens are out
    thread.join(5)
    assert took and 0.55 <= took[0] < 5 and hold.held_s >= 0.55


def test_a_prefill_step_with_no_step_after_it_holds_the_publisher_for_its_tail():
    hold = PrefillHold(max_s=30, tail_s=0.3)
    hold.step(255)
    thread, took = _waiter(hold)
    thread.join(0.2)
    assert thread.is_alive() and not took
    hold.step_done()  # the engine goes idle: no step releases the hold
    thread.join(10)
    assert took and 0.2 + 0.25 <= took[0] < 5, "the tail did not hold, or held past its bound"


def test_a_long_prefill_holds_the_publisher_no_longer_than_its_bound():
    hold = PrefillHold(max_s=0.3)
    hold.step(10_000)
    thread, took = _waiter(hold)
    thread.join(10)
    assert took and 0.25 <= took[0] < 5, "a long prefill held publication past its bound"


def test_step_after_step_of_prefill_holds_no_longer_than_its_bound_then_gives_way():
    """A long prompt prefills in many steps (or prompts keep coming): each re-arms the hold,
    but a stretch of holding ends ``max_s`` after it began, and background work then runs
    free for ``free_s`` whatever the steps prefill."""
    hold = PrefillHold(max_s=0.3, tail_s=30, free_s=0.6)
    hold.step(2048)
    thread, took = _waiter(hold)
    free_waits: list[float] = []
    stop = time.monotonic() + 3
    while time.monotonic() < stop:  # a chunk every 50 ms
        hold.step_done()
        hold.step(2048)
        if not thread.is_alive() and len(free_waits) < 5:
            t = time.monotonic()
            hold.wait()  # inside the free window: no wait
            free_waits.append(time.monotonic() - t)
        time.sleep(0.05)
    thread.join(1)
    assert took and 0.25 <= took[0] < 1.5, f"a wait lasted {took} while step after step prefilled"
    assert len(free_waits) == 5 and max(free_waits) < 0.1, f"background work was held in its free window: {free_waits}"
    time.sleep(1.0)  # past any stretch and free window: the next prefill step holds again
    hold.step(2048)
    thread, took = _waiter(hold)
    thread.join(0.1)
    assert thread.is_alive() and not took, "the next stretch did not hold"
    hold.step(0)
    thread.join(5)
    assert took


def test_prefill_tokens_count_what_a_step_schedules_beyond_decoding():
    assert prefill_tokens({}, {}) == 0
    assert prefill_tokens({"a": 1, "b": 1}, None) == 0
    assert prefill_tokens({"a": 1, "b": 300}, {}) == 299
    assert prefill_tokens({"a": 4, "b": 1}, {"a": [5, 6, 7]}) == 0  # a's draft tokens are decoding
    assert prefill_tokens({"a": 100}, {"a": [5]}) == 98


def test_vllms_scheduler_steps_say_whether_they_prefill(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    s.add_request(request("a", list(range(3, 203))))
    first = step(s, 7)
    assert first.num_scheduled_tokens == {"a": 200}
    assert first.kv_connector_metadata.prefill_tokens == 199
    second = step(s, 7)
    assert second.num_scheduled_tokens == {"a": 1} and second.kv_connector_metadata.prefill_tokens == 0


def test_a_capture_published_during_a_prefill_step_waits_for_the_step_to_end(tmp_path):
    kv = vllm_kv_caches("LBHNC", 1, seed=5)
    worker = _worker(kv, tmp_path / "store", "read-write")
    try:
        worker.hold.max_s = 30
        worker.hold.step(255)
        worker.capture(CapturePlan("r", _keys(8), 0, [list(range(1, 9))]))
        time.sleep(0.5)
        stats = worker.slots.stats
        assert stats.published == 0 and worker.store.objects.list() == [], "published while the step prefilled"
        worker.hold.step_done()
        _wait(lambda: stats.published == 1)
    finally:
        worker.close()


def test_vllm_binds_a_steps_metadata_before_its_forward_and_starts_its_loads_after_it(tmp_path):
    """Where the hold is armed: vLLM 0.32.0's model runner (its real
    ``_get_kv_connector_output``, around a step's forward) binds the step's metadata before the
    forward and, unless the step loads synchronously, calls ``start_load_kv`` after it. So the
    connector arms the hold in ``bind_connector_metadata``: armed in ``start_load_kv`` it
    would come after the prefill it is meant to protect."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from sparkcache.connector.connector import SparkcacheConnector

    s = make_scheduler(str(tmp_path), hybrid=False)
    s.add_request(request("a", list(range(3, 203))))
    out = s.schedule()
    assert out.kv_connector_metadata.prefill_tokens == 199 and not out.has_sync_kv_loads
    events: list[str] = []

    class Order(KVConnectorBase_V1):  # vLLM's own base class; records which hook came when
        def bind_connector_metadata(self, connector_metadata):
            super().bind_connector_metadata(connector_metadata)
            events.append("bind")

        def start_load_kv(self, forward_context, **kwargs):
            events.append("start_load_kv")

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            events.append("wait_for_save")

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return None

    saved = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = Order(s.vllm_config, KVConnectorRole.WORKER, s.kv_cache_config)
    try:
        with set_forward_context(None, s.vllm_config):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(out):
                events.append("forward")
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved
    assert events == ["bind", "forward", "start_load_kv", "wait_for_save"], events
    # and sparkcache's connector arms its hold in the hook that comes first
    assert "bind_connector_metadata" in vars(SparkcacheConnector)


@contextlib.contextmanager
def _one_rank_worker_groups(vllm_config):
    """vLLM's distributed groups of a one-rank worker (gloo on 127.0.0.1), initialised as vLLM
    does before it builds a worker's connector, and torn down after."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 ensure_model_parallel_initialized,
                                                 init_distributed_environment)

    from testing.seaweedfs import free_ports

    (port,) = free_ports(1)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def test_the_holds_hooks_on_the_model_thread_count_into_the_worker_step(tmp_path):
    """``bind_connector_metadata`` arms the hold and ``wait_for_save`` starts its tail, both on
    vLLM's model thread: their time is the step's time in the connector
    (``worker_step_seconds``, the histogram the capture step's 1 ms target reads). Here a
    background thread keeps the hold's lock for 0.3 s while each hook runs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from sparkcache.connector.connector import SparkcacheConnector

    s = make_scheduler(str(tmp_path), hybrid=False)
    s.add_request(request("a", list(range(3, 203))))
    meta = s.schedule().kv_connector_metadata
    assert meta.prefill_tokens == 199
    with _one_rank_worker_groups(s.vllm_config):
        conn = SparkcacheConnector(s.vllm_config, KVConnectorRole.WORKER, s.kv_cache_config)
        try:
            hold = conn._worker.hold
            for hook in (lambda: conn.bind_connector_metadata(meta), conn.wait_for_save):
                locked = threading.Event()

                def keep_the_lock() -> None:
                    with hold._changed:
                        locked.set()
                        time.sleep(0.3)

                background = threading.Thread(target=keep_the_lock, daemon=True)
                background.start()
                assert locked.wait(5)
                hook()
                background.join(5)
                conn.build_connector_worker_meta()  # the step's last worker hook records its time
                step_s = conn._worker.take_observations()["worker_step_seconds"]
                assert step_s and step_s[-1] >= 0.25, (hook, step_s)
        finally:
            conn.shutdown()
