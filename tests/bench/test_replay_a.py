"""Replay A in a small, fast configuration: vLLM 0.32.0's real Scheduler (pristine and
transformed trees, one subprocess per arm), the real PageStore, synthetic model outputs.

Asserts the issue's inequalities on a default-shaped run (KV pool = headroom x the starting
contexts, the pressure that reproduces Report A's loss, see docs/RESULTS.md): the untransformed
tree loses local hits and restores avoidable prefixes, the transformed read-write arm keeps them
and rescues evicted turns from the store; plus the store's rescue after a simulated engine restart,
with the replay's adapter and with the real connector's scheduler side (emulated worker).
"""

from __future__ import annotations

import csv

import pytest

from bench import replay_a

pytestmark = [pytest.mark.slow]

# Default-shaped (4 agents, default starts, reasoning, headroom), shortened.
PRESSURE = ["--duration", "2400", "--seed", "0"]
SMALL = ["--agents", "3", "--start-tokens", "1500,3000", "--growth-tokens", "48", "--reply-tokens", "16",
         "--reasoning-tokens", "16", "--new-conversation-after", "2000", "--kv-pool-tokens", "40000",
         "--duration", "900", "--seed", "1"]


@pytest.fixture(scope="module")
def normal(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay-a")
    return replay_a.run(["--out", str(out), "--arms", "read-write,read-write-untransformed,restore-only",
                         "--jobs", "3", *PRESSURE]), out


@pytest.fixture(scope="module")
def restart(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay-a-restart")
    return replay_a.run(["--out", str(out), "--arms", "read-write", "--restart-at", "450", *SMALL])


def test_outputs_written(normal):
    summary, out = normal
    assert (out / "turns.csv").read_text().startswith("arm,agent,conversation,turn,prompt_tokens")
    assert (out / "trace.png").stat().st_size > 1000
    for arm, s in summary["arms"].items():
        assert s["continuation_turns"] >= 15, (arm, s)
        assert s["evicted_cached_blocks"] > 0, (arm, s)
        assert s["local_tokens"] + s["external_tokens"] + s["recomputed_tokens"] == s["prompt_tokens"]
        assert s["failed_restore_reads"] == 0 and s["publish_failures"] == 0
    assert "/.cache/replay-tree/" in summary["arms"]["read-write"]["scheduler_file"]
    assert "/site-packages/vllm/" in summary["arms"]["read-write-untransformed"]["scheduler_file"]


def test_read_write_keeps_local_hits(normal):
    summary, out = normal
    rw, ro = summary["arms"]["read-write"], summary["arms"]["restore-only"]
    assert rw["continuation_local_ge_50pct_fraction"] >= 0.97, rw
    assert rw["avoidable_external_tokens"] == 0, rw
    # The workload is the same per (agent, turn) in every arm; arms finish different numbers of
    # turns in the soak, so compare the local-hit share on the continuation turns both ran.
    rows = list(csv.DictReader(open(out / "turns.csv")))
    by_arm = {a: {(r["agent"], r["turn"]): r for r in rows if r["arm"] == a and r["continuation"] == "True"}
              for a in ("read-write", "restore-only")}
    common = sorted(set(by_arm["read-write"]) & set(by_arm["restore-only"]))
    assert len(common) >= 15

    def share(arm):
        return sum(int(by_arm[arm][k]["local_tokens"]) for k in common) / sum(
            int(by_arm[arm][k]["prompt_tokens"]) for k in common)

    assert share("read-write") >= share("restore-only"), (share("read-write"), share("restore-only"))
    assert rw["captures"] > 0 and ro["captures"] == 0


def test_image_turns_carry_real_mm_features_and_keep_their_local_hits(normal):
    """Every 10th turn adds an image (its ``mm_features``: an identifier and its offset); the
    turns after it are neither skipped nor lost to the store (at 403da3e the connector offered
    and captured nothing for them)."""
    summary, out = normal
    rows = [r for r in csv.DictReader(open(out / "turns.csv")) if r["arm"] == "read-write"]
    assert any(int(r["images"]) for r in rows)
    rw = summary["arms"]["read-write"]
    assert rw["continuation_turns_after_image"] > 0, rw
    assert rw["continuation_turns_after_image_local_ge_50pct"] >= 0.97 * rw["continuation_turns_after_image"], rw


def test_store_rescues_after_engine_restart(restart):
    rw = restart["arms"]["read-write"]
    assert rw["restarts"] == 1
    assert rw["rescued_turns"] > 0, rw
    lat = rw["median_latency_s"]
    assert lat["rescued"] < lat["rescued_if_recomputed"], lat
    assert rw["avoidable_external_tokens"] == 0, rw


def test_real_connector_scheduler_side_rescues_after_restart(tmp_path):
    # The real sparkcache.connector scheduler side plans every load and capture; the replay only
    # emulates the worker (bench.replay_a_worker) on the simulated clock, through the real store.
    # An image every other turn, so turns that carry one are rescued after the restart too.
    summary = replay_a.run(["--out", str(tmp_path), "--connector", "sparkcache", "--arms", "read-write",
                            "--restart-at", "450", *SMALL, "--image-every", "2"])
    assert summary["connector"].startswith("sparkcache.connector")
    rw = summary["arms"]["read-write"]
    assert rw["restarts"] == 1 and rw["captures"] > 0
    assert rw["rescued_turns_after_image"] > 0, rw  # image turns restored by the real scheduler side
    assert rw["failed_restore_reads"] == 0 and rw["publish_failures"] == 0
    assert rw["rescued_turns"] > 0, rw
    lat = rw["median_latency_s"]
    assert lat["rescued"] < lat["rescued_if_recomputed"], lat
    assert rw["avoidable_external_tokens"] == 0, rw


def test_glm5next_layout_rescues_after_restart_with_the_real_scheduler_side(tmp_path):
    """``--layout glm5next``: vLLM's scheduler gets GLM-5.3's groups as vLLM 0.32.0 builds them
    (3 KDA, MLA + indexer, the tail ring: ``testing/field_layouts.py``) at the replay's block
    size; the real scheduler side stores and offers them (at 403da3e: refused, nothing stored)."""
    summary = replay_a.run(["--out", str(tmp_path), "--connector", "sparkcache", "--arms", "read-write",
                            "--layout", "glm5next", "--restart-at", "450", *SMALL])
    rw = summary["arms"]["read-write"]
    assert rw["restarts"] == 1 and rw["captures"] > 0
    assert rw["failed_restore_reads"] == 0 and rw["publish_failures"] == 0
    assert rw["rescued_turns"] > 0, rw
    assert rw["avoidable_external_tokens"] == 0, rw


def test_read_write_rescues_evicted_turns(normal):
    summary, _ = normal
    rw = summary["arms"]["read-write"]
    assert rw["rescued_turns"] > 0, rw
    lat = rw["median_latency_s"]
    assert lat["rescued"] < lat["rescued_if_recomputed"], lat


def test_untransformed_reproduces_report_a_loss(normal):
    summary, _ = normal
    un = summary["arms"]["read-write-untransformed"]
    assert un["continuation_local_lt_50pct_fraction"] >= 0.25, un
    assert un["avoidable_external_tokens"] > 0, un


def test_reports_alone_advance_no_clock():
    # Seed 0, 3 agents, starts 5000-10000 once stopped "stuck" at t=2415.5: a restore finished
    # after the last arrival, and the step that delivered finished_recving ran no tokens, so the
    # loop looked for something to wait on instead of letting vLLM act on the report.
    from bench.replay_a_sim import clock_after_step

    assert clock_after_step(2415.5, 0.0, True, None, []) == 2415.5
    assert clock_after_step(2415.5, 0.0, False, None, []) is None  # nothing pending: done or stuck
    assert clock_after_step(100.0, 0.0, False, 130.0, [110.0]) == 110.0
    assert clock_after_step(100.0, 2.5, False, 101.0, []) == 102.5


def test_a_preempting_step_is_not_a_stall(tmp_path):
    # Seed 2929, 2 agents at 6000-9000 once stopped the untransformed arm "stuck" at t=1440.7 s
    # with a preempted request at the head of the waiting queue and 533 of 953 blocks free:
    # vLLM's schedule() admits no waiting request in a step that preempted, so that step ran no
    # tokens, and the loop took it for idle instead of letting vLLM use the freed blocks.
    from bench.replay_a_sim import clock_after_step

    assert clock_after_step(1440.7, 0.0, True, None, []) == 1440.7
    summary = replay_a.run(["--out", str(tmp_path), "--seed", "2929", "--agents", "2", "--start-tokens",
                            "6000,9000", "--growth-tokens", "80", "--arms", "read-write-untransformed"])
    un = summary["arms"]["read-write-untransformed"]
    assert un["preemptions"] > 0 and un["stalled"] is None, un
    assert all(ok for _, ok in summary["checks"]), summary["checks"]


def test_a_stalled_arm_is_reported_and_the_others_still_checked(normal):
    summary, out = normal
    rows = list(csv.DictReader(open(out / "turns.csv")))
    for r in rows:  # csv gives strings; checks() reads these as numbers and booleans
        r.update(local_tokens=int(r["local_tokens"]), prompt_tokens=int(r["prompt_tokens"]),
                 continuation=r["continuation"] == "True")
    cause = "scheduler stuck at t=1440.7 s: vLLM holds a0-t7 (PREEMPTED, prompt 8475, computed 0)"
    stalled = {**summary, "arms": {**summary["arms"], "read-write-untransformed": {
        **summary["arms"]["read-write-untransformed"], "stalled": cause}}}
    got = replay_a.checks(stalled, rows)
    assert (f"read-write-untransformed ran to the end: {cause}", False) in got
    assert not any(text.startswith("untransformed") for text, _ in got)  # its numbers end early
    assert [c for c in got if "read-write-untransformed" not in c[0]] == [
        c for c in replay_a.checks(summary, rows) if not c[0].startswith("untransformed")]
    assert "| ran to the end | yes | **stalled at" in replay_a.table(stalled)


def test_refuses_a_pool_smaller_than_one_request(tmp_path):
    # One agent at 5000-10000: 1.08 x its start cannot hold the conversation it grows into.
    with pytest.raises(SystemExit, match="--kv-pool-tokens .* raise --kv-pool-tokens or --kv-pool-headroom"):
        replay_a.run(["--out", str(tmp_path), "--agents", "1", "--start-tokens", "5000,10000",
                      "--arms", "read-write"])
    assert not any(tmp_path.iterdir())  # refused before any work


def test_pool_basis_expected_peak():
    def cfg(*extra):
        return replay_a.config_from(replay_a.parser().parse_args(["--out", "x", "--agents", "3",
                                                                  "--start-tokens", "1600,3200", *extra]))

    start, peak = cfg(), cfg("--kv-pool-basis", "expected-peak")
    assert start["expected_peak_context_tokens"] == peak["expected_peak_context_tokens"]
    assert peak["starting_context_tokens"] < peak["expected_peak_context_tokens"]
    assert peak["kv_pool_tokens"] == -(-round(0.96 * peak["expected_peak_context_tokens"]) // 16) * 16
    assert start["kv_pool_tokens"] == -(-round(1.08 * start["starting_context_tokens"]) // 16) * 16
    # Growth stops at --new-conversation-after: a long run's peak is capped per agent.
    long = cfg("--duration", "100000", "--new-conversation-after", "500")
    assert long["expected_peak_context_tokens"] == long["starting_context_tokens"] + 3 * 500



def test_a_step_that_completes_a_prefill_is_costed_as_prefill():
    # Replay A's cost model reads each request's progress after schedule(), which has already
    # advanced num_computed_tokens by the step's chunk: the chunk that completes a prompt (a
    # whole 16-token prompt; the last of an 80-token prompt's chunks) is still prefill, and only
    # the steps after it decode. Once counted as decode, with no prefill tokens.
    from bench.replay_a_sim import step_cost
    from testing.vllm_scheduler import make_request, make_scheduler, step

    scheduler = make_scheduler(None, max_model_len=1024, max_num_batched_tokens=32)  # chunks of 32 at most
    for rid, prompt in (("one-chunk", range(100, 116)), ("chunked", range(200, 280))):
        request = make_request(rid, list(prompt), max_tokens=3)
        scheduler.add_request(request)
        costs = []
        while not request.is_finished():
            step(scheduler, on_scheduled=lambda out: costs.append(
                (out.num_scheduled_tokens[rid], *step_cost(scheduler, out))))
        prefill = [n for n, _, _ in costs[:-2]]
        assert sum(prefill) == len(prompt), costs
        assert costs == [(n, n, False) for n in prefill] + [(1, 0, True)] * 2, costs


def test_residency_is_the_admitting_asks_not_a_resumed_ones():
    """A preempted request is asked again when it resumes, after it computed blocks itself; the
    turn's local and external tokens are its first admission's, so is the residency they are
    compared with (Replay A on GLM-5.3's layout, seed 1: a turn preempted twice read as 416
    avoidable tokens)."""
    from bench.replay_a_connector import ReplayContext
    from testing import vllm_scheduler as h

    scheduler = h.make_scheduler(h.probe_connector(None))
    ctx = ReplayContext(store=None, identity=None, mode="read-write", block_size=h.BLOCK_SIZE,
                        kv_bytes_per_block=1.0, restore_bps=1.0, capture_bps=1.0)
    request = h.make_request("r", list(range(100, 200)), max_tokens=2)
    ctx.note_residency(scheduler, request)  # vLLM's ask before admitting it: nothing resident
    assert ctx.residency["r"]["attn_tokens"] == 0
    h.run_to_completion(scheduler, request)
    request.num_preemptions = 1  # as a preemption leaves it; its own blocks are resident now
    ctx.note_residency(scheduler, request)
    assert ctx.residency["r"]["attn_tokens"] == 0
    ctx.residency.clear()
    request.num_preemptions = 0
    ctx.note_residency(scheduler, request)  # the same ask before any admission sees them
    assert ctx.residency["r"]["attn_tokens"] == 96
