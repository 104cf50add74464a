"""Background work holds still while the model prefills (``prefill_hold.py``): the model's
thread, the publisher and the maintenance thread share one interpreter lock (and, on a
machine of two cores, the cores), and a prefill is what a waiting user's first token waits
on. A step that prefills holds publication and maintenance until its first token is out (the
next step starts without prefilling, or ``tail_s`` after its forward), for at most ``max_s``;
a decode step holds nothing.

Real parts: vLLM's Scheduler with sparkcache's scheduler half (what a step's metadata says),
sparkcache's worker half capturing out of vLLM's own CPU KV layout into its store on disk."""

from __future__ import annotations

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
    assert took and 0.6 <= took[0] < 5 and hold.held_s >= 0.6


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


def test_step_after_step_of_prefill_holds_each_wait_no_longer_than_its_bound():
    """A long prompt prefills in many steps: each re-arms the hold, but a wait that began
    under one of them ends ``max_s`` after it began."""
    hold = PrefillHold(max_s=0.3, tail_s=30)
    hold.step(2048)
    thread, took = _waiter(hold)
    stop = time.monotonic() + 3
    while time.monotonic() < stop and thread.is_alive():  # a chunk every 50 ms
        hold.step_done()
        hold.step(2048)
        time.sleep(0.05)
    thread.join(1)
    assert took and 0.25 <= took[0] < 1.5, f"a wait lasted {took} while step after step prefilled"


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
