"""One engine life in a fresh process: start ``vllm.LLM`` on CPU, generate, report JSON, exit.

Used by the host suite (tests/connector), the benchmarks and the contract suite inside an
image, through ``run_in_fresh_process``, which gives each life a private ``/dev/shm``
(contracts/private_shm.py) where it can, and never removes anything from the host's; on its own:

    python -m contracts.engine_driver '{"model": DIR, "connector": "sparkcache"|"example"|"none",
        "extra": {...}, "prompts": [[ids...]], "max_tokens": 16, "block_size": 32}'   (or @FILE holding that JSON)

A prompt is a list of token ids, or ``{"ids": [...], "cache_salt": "s", "lora": {"name": "a",
"id": 1, "path": DIR}, "images": [PNG, ...], "embeds": FILE}`` (keys but ``ids`` optional): the salt goes into ``TokensPrompt(cache_salt=)``,
the adapter into ``llm.generate(lora_request=LoRARequest(name, id, path))``, the images (one per
image placeholder in ``ids``, which vLLM's processor expands; with ``"chain"`` a conversation's
images so far come along) into ``multi_modal_data``; ``embeds``, a ``torch.save``d [tokens,
hidden] tensor, is sent as an ``EmbedsPrompt`` instead of ``ids`` (the life needs
``"prompt_embeds": true``, vLLM's ``enable_prompt_embeds``). LoRA must be
enabled for the engine life with ``"lora": {"max_lora_rank": 8, "max_loras": 2}`` (both
optional, defaults shown), e.g. with an adapter from ``testing.tinymodel.make_tiny_lora``;
with it on, a prompt without an adapter runs on the base model. ``"load_failure_policy"``
sets ``kv_load_failure_policy`` (default ``"recompute"``); ``"mamba_cache_mode"`` (e.g.
``"align"``) is passed to vLLM for hybrid models, ``"attention_backend"`` (e.g. ``"CPU_MLA"``)
and ``"disable_hybrid_kv_cache_manager": true`` (sliding-window models: one full-attention
group that keeps every block) too; ``"logprobs": true`` reports each output
token's logprob; ``"enforce_eager": true`` runs without torch.compile (the host tests' engine lives
do: compiling is slow on a CPU and changes nothing the connector does; docs/RESULTS.md,
"Measurements behind the code"; the image's contract and ``vllm serve`` in the serve tests run compiled, as operators do); ``"tensor_parallel_size"`` (default 1) runs that many ranks, one worker
process each (on CPU give each its core: ``VLLM_CPU_OMP_THREADS_BIND``, and keep gloo on
loopback: ``GLOO_SOCKET_IFNAME=lo``, ``VLLM_HOST_IP=127.0.0.1``); ``"chain": true`` makes a conversation: each prompt after the first is the
previous prompt, its output and then its own ids; ``"check_units": {"root": R, "ranks": N}``
(or ``"roots": [R0, R1, ...]``, one per rank; optional ``"namespace"``) checks after every
request that the stores hold no entry with only some of the N tensor-parallel ranks' shards,
once its publications settled (quiet for 2 s; the deadline, ``"deadline_s"``, default 120 s,
only guards against a hang: on a disk that other writers keep busy a publication's three sync
rounds alone can outlast a short bound, docs/RESULTS.md; keep requests x deadline under the life's timeout); per result: ``incomplete_units``,
``units_quiet`` (false: the deadline passed first; then ``units_changes`` says what kept
moving and what was there at the deadline) and ``units_settle_s``. ``"in_process": true`` runs
vLLM's engine core, and with one rank its worker, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one import of vLLM instead of three; docs/RESULTS.md,
"Measurements behind the code"); after every request the engine is then stepped as
``EngineCore.run_busy_loop`` steps it, while the scheduler has work (the connector's
``has_pending_push_work``), so captures settle and their stats arrive as in a served engine.
``"phases": [{"prompts": [...]}, ...]`` (instead of ``"prompts"``) runs several rounds in one
life: before each round after the first, the engine waits for ``run_in_fresh_process``'s
``between`` and then drops its GPU prefix cache (``llm.reset_prefix_cache()``), so that round
finds only what the connector restores, as after a restart, without paying for another start;
the result then holds ``"phases"``: per round its ``results`` and ``metrics`` (a counter's
growth during that round, a gauge's value at its end).

Prints one line ``ENGINE-RESULT {json}``: per prompt the output token ids, vLLM's
``num_cached_tokens``, the ``kv_transfer_params`` (sparkcache's attribution record), the
wall time of the generate call, and vLLM's own counters (``llm.get_metrics()``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from contracts.private_shm import MARKER


def run(cfg: dict) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cfg.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kvt = None
    if cfg.get("connector", "sparkcache") == "sparkcache":
        kvt = KVTransferConfig(kv_connector="SparkcacheConnector",
                               kv_connector_module_path="sparkcache.connector", kv_role="kv_both",
                               kv_load_failure_policy=cfg.get("load_failure_policy", "recompute"),
                               kv_connector_extra_config=dict(cfg.get("extra") or {}))
    elif cfg["connector"] == "example":
        kvt = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": cfg["example_path"]})
    lora = cfg.get("lora")
    lora_kwargs = {}
    if lora is not None:
        lora_kwargs = {"enable_lora": True, "max_lora_rank": lora.get("max_lora_rank", 8),
                       "max_loras": lora.get("max_loras", 2)}
    t0 = time.monotonic()
    engine_kwargs = {"mamba_cache_mode": cfg["mamba_cache_mode"]} if cfg.get("mamba_cache_mode") else {}
    if cfg.get("attention_backend"):
        engine_kwargs["attention_backend"] = cfg["attention_backend"]
    if cfg.get("disable_hybrid_kv_cache_manager"):  # sliding-window models: every block kept
        engine_kwargs["disable_hybrid_kv_cache_manager"] = True
    if cfg.get("prompt_embeds"):
        engine_kwargs["enable_prompt_embeds"] = True
    llm = LLM(model=cfg["model"], dtype=cfg.get("dtype", "float32"), enable_prefix_caching=True,
              max_model_len=cfg.get("max_model_len", 4096), block_size=cfg.get("block_size", 32),
              kv_transfer_config=kvt, disable_log_stats=False, seed=0,
              max_num_batched_tokens=cfg.get("max_num_batched_tokens", 4096), **lora_kwargs,
              **engine_kwargs, tensor_parallel_size=cfg.get("tensor_parallel_size", 1),
              enforce_eager=cfg.get("enforce_eager", False))
    startup_s = time.monotonic() - t0
    params = SamplingParams(max_tokens=cfg.get("max_tokens", 16), temperature=0.0, ignore_eos=True,
                            logprobs=0 if cfg.get("logprobs") else None)
    if "phases" not in cfg:
        out = {**_generate(llm, cfg, cfg["prompts"], params), "metrics": _metrics(llm)[1]}
    else:
        phases: list[dict] = []
        totals: dict[str, float] = {}
        for i, phase in enumerate(cfg["phases"]):
            if i > 0:
                if cfg.get("pause_dir"):
                    _pause(Path(cfg["pause_dir"]), i, phases)
                if not llm.reset_prefix_cache():
                    raise RuntimeError(f"phase {i}: vLLM refused to reset its prefix cache (a request still running?)")
            done = _generate(llm, cfg, phase["prompts"], params)
            totals, metrics = _metrics(llm, totals)
            phases.append({**done, "metrics": metrics})
        out = {"phases": phases}
    try:  # shut the engine (and its processes) down before reporting
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return {**out, "startup_s": startup_s}


def _generate(llm, cfg: dict, prompts: list, params) -> dict:
    """Each prompt through ``llm.generate`` in turn (see the module doc): ``{"results": [...]}``."""
    from vllm.lora.request import LoRARequest

    results = []
    history: list[int] = []
    images: list[str] = []  # of the conversation so far (``chain``), else of this prompt
    for item in prompts:
        item = item if isinstance(item, dict) else {"ids": item}
        ids = item["ids"]
        if cfg.get("chain") and results:  # a conversation: the last prompt and its answer first
            ids = history + ids
        else:
            images = []
        history = list(ids)
        images += item.get("images", [])
        prompt = _prompt(ids, images, item.get("embeds"))
        if item.get("cache_salt") is not None:
            prompt["cache_salt"] = item["cache_salt"]
        adapter = item.get("lora")
        lora_request = (LoRARequest(adapter["name"], adapter["id"], adapter["path"])
                        if adapter else None)
        t = time.monotonic()
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)[0]
        logprobs = ([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                    if cfg.get("logprobs") else None)
        results.append({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                        "logprobs": logprobs,
                        "kv_transfer_params": out.kv_transfer_params,
                        "generate_s": time.monotonic() - t, "prompt": ids,
                        "prompt_tokens": len(out.prompt_token_ids or ()) or len(ids)})
        history += results[-1]["tokens"]
        if cfg.get("in_process"):
            _step_while_the_scheduler_has_work(llm)
        if cfg.get("check_units"):
            results[-1].update(_settled_units(cfg["check_units"]))
    return {"results": results}


def _prompt(ids: list[int], images: list[str], embeds: str | None):
    """vLLM's prompt for token ``ids`` with ``images`` (PNG paths, one per image placeholder in
    ``ids``, which vLLM's processor expands), or for the prompt embeddings saved at ``embeds``
    (``torch.save`` of a [tokens, hidden] tensor; ``ids`` unused)."""
    from vllm.inputs import EmbedsPrompt, TokensPrompt

    if embeds is not None:
        import torch

        return EmbedsPrompt(prompt_embeds=torch.load(embeds))
    prompt = TokensPrompt(prompt_token_ids=ids)
    if images:
        from PIL import Image

        prompt["multi_modal_data"] = {"image": [Image.open(p).convert("RGB") for p in images]}
    return prompt


def _metrics(llm, before: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """vLLM's counters and gauges that the tests read, by ``name{labels json}``: (the counters'
    totals, each metric as reported: a gauge's value, a counter's growth since ``before``)."""
    from vllm.v1.metrics.reader import Counter

    totals, reported = {}, {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:prefix_cache", "vllm:external_prefix", "vllm:sparkcache",
                              "vllm:prompt_tokens")):
            value = getattr(m, "value", None)
            if value is None:
                continue
            key = m.name + json.dumps(getattr(m, "labels", {}), sort_keys=True)
            if isinstance(m, Counter):
                totals[key] = value
                value -= (before or {}).get(key, 0.0)
            reported[key] = value
    return totals, reported


def _pause(pause_dir: Path, phase: int, done: list[dict]) -> None:
    """Hand the phases so far to ``run_in_fresh_process``'s ``between`` (``pause-N.json``) and
    wait for its ``go-N`` (the parent kills this process at the life's timeout)."""
    tmp = pause_dir / f".pause-{phase}.json"
    tmp.write_text(json.dumps(done))
    tmp.rename(pause_dir / f"pause-{phase}.json")
    while not (pause_dir / f"go-{phase}").exists():
        time.sleep(0.05)


def _step_while_the_scheduler_has_work(llm, timeout_s: float = 600.0) -> None:
    """What ``EngineCore.run_busy_loop`` does with an engine whose requests finished: step
    while ``scheduler.has_requests()`` (delayed frees, the connector's pending push work),
    sleeping 1 ms after a step that ran no model, as ``_process_engine_step`` does."""
    core = llm.llm_engine.engine_core.engine_core  # InprocClient's EngineCore
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler still had work after {timeout_s:g} s of idle steps")
        llm.llm_engine.step()
        time.sleep(0.001)


def _settled_units(check: dict, quiet_s: float = 2.0) -> dict:
    """Wait until the stores are quiet (no live publication, the same entries for ``quiet_s``:
    the engine captures a finished request in its next steps), or the deadline passes; the
    entries then lacking a rank's shard, whether it got quiet, and how long the wait took."""
    from sparkcache.store import PageStore, incomplete_units

    roots = check.get("roots") or [check["root"]]
    deadline_s = float(check.get("deadline_s", 120.0))
    t = time.monotonic()
    seen, since = None, t
    changes: list[str] = []  # what moved, for a store that does not get quiet
    while True:
        stores = [PageStore(r, namespace=check.get("namespace", "default"), read_only=True) for r in roots]
        views = [(st.entries(), os.listdir(st.layout.staging_dir)) for st in stores]  # one view per store
        now = tuple((frozenset(e.entry_id for e in entries), frozenset(staging)) for entries, staging in views)
        if now != seen:
            if seen is not None:
                changes.append(_change(time.monotonic() - t, seen, now))
            seen, since = now, time.monotonic()
        quiet = not any(staging for _, staging in now) and time.monotonic() - since >= quiet_s
        if quiet or time.monotonic() - t > deadline_s:
            entries = [e for entries, _ in views for e in entries]  # the view judged quiet
            bad = incomplete_units(entries, int(check["ranks"]))
            still = [f"root {i}: {len(e)} entries, staging {sorted(st)}" for i, (e, st) in enumerate(now)]
            return {"incomplete_units": [[u.block_count, list(u.ranks)] for u in bad],
                    "units_quiet": quiet, "units_settle_s": time.monotonic() - t,
                    "units_changes": [] if quiet else changes[-20:] + ["at the deadline: " + "; ".join(still)]}
        time.sleep(0.1)


def _change(at: float, before: tuple, after: tuple) -> str:
    """One line per root that moved: entries added and removed, staging names now."""
    parts = []
    for root, ((e0, s0), (e1, s1)) in enumerate(zip(before, after)):
        if (e0, s0) != (e1, s1):
            parts.append(f"root {root}: entries +{len(e1 - e0)} -{len(e0 - e1)} "
                         f"(now {len(e1)}), staging {sorted(s1)}")
    return f"{at:.1f} s: " + "; ".join(parts)


RESULT_MARKER = "ENGINE-RESULT "


def run_in_fresh_process(cfg: dict, cwd: Path, timeout: int = 500,
                         command: tuple[str, ...] = ("contracts.engine_driver",),
                         env: dict[str, str] | None = None,
                         between: Callable[[int, list[dict]], None] | None = None) -> dict:
    """``python -m *command @FILE`` (``FILE``: the JSON of ``cfg``; ``load_cfg`` reads it) in a new interpreter (its own session, killed with its
    group afterwards: engine processes ignore SIGTERM), with ``cwd`` first on PYTHONPATH; the
    child prints one ``ENGINE-RESULT {json}`` line. Returns that JSON plus ``log`` (the tail of
    its output) and ``shm`` (below); raises RuntimeError with that output when the child fails.
    ``env`` adds to (or overrides) this process's environment for the child; its ``PYTHONPATH`` goes first.
    ``between(i, phases_done)`` runs here before phase ``i`` (1, 2, ...) of a life with
    ``"phases"``, while the engine waits (e.g. to damage the store it serves).

    The life runs with a private ``/dev/shm`` (contracts/private_shm.py): what its processes
    leave there (vLLM's shared-memory rings; a killed engine never unlinks its segments) goes
    with them, and nothing of another program's (a ``vllm serve`` beside a bench, its
    multiprocessing semaphores) is touched; ``shm`` is then ``{"private": true}``. Where no
    namespace can be made, the life shares the host's ``/dev/shm`` and nothing is removed: no
    file there says which process made it (glibc maps a semaphore under a temporary name, so
    ``/proc/*/maps`` never shows ``sem.mp-*``), so nothing new is provably the life's; ``shm`` is ``{"private": false, "reason": ..., "left": [the
    entries that appeared during the life]}`` and a line on stderr names them."""
    extra = dict(env or {})
    first = extra.pop("PYTHONPATH", None)  # e.g. a transformed vLLM tree, ahead of cwd
    env = dict(os.environ, **extra, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [first, str(cwd), os.environ.get("PYTHONPATH")])))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    shm_before = _shm_entries()
    # Files, not pipes, so a straggler that inherited them cannot keep us waiting. The config
    # goes in a file too: one argument may not exceed 128 KiB, a 32K-token prompt's ids do.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("w", suffix=".json") as cfg_file, \
            tempfile.TemporaryDirectory() as pause_dir:
        json.dump({**cfg, "pause_dir": pause_dir} if between else cfg, cfg_file)
        cfg_file.flush()
        p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("private_shm.py")), "--",
                              sys.executable, "-m", *command, "@" + cfg_file.name],
                             cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            _wait(p, timeout, Path(pause_dir), between)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    shm = _shm_report(stderr, shm_before)
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
            # the log without the result line (a 32K-token prompt's ids alone fill 130 KB)
            logged = "\n".join(x for x in stdout.splitlines() if not x.startswith(RESULT_MARKER))
            result["log"] = logged[-20000:] + stderr[-20000:]
            result["shm"] = shm
            return result
    raise RuntimeError(f"engine life `python -m {' '.join(command)} @CFG_FILE` failed (rc={p.returncode}, "
                       f"timeout {timeout} s); its output ends:\n{stdout[-4000:]}\n{stderr[-8000:]}")


def _wait(p: subprocess.Popen, timeout: float, pause_dir: Path,
          between: Callable[[int, list[dict]], None] | None) -> None:
    """Until the child exits or ``timeout`` passes, answering each pause of its phases."""
    deadline = time.monotonic() + timeout
    phase = 1
    while time.monotonic() < deadline:
        try:
            p.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())) if between else timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        paused = pause_dir / f"pause-{phase}.json"
        if between is not None and paused.exists():
            between(phase, json.loads(paused.read_text()))
            (pause_dir / f"go-{phase}").touch()
            phase += 1


_SHM = Path("/dev/shm")


def _shm_entries() -> set[str]:
    try:
        return {e.name for e in os.scandir(_SHM)}
    except OSError:
        return set()


def _shm_report(stderr: str, before: set[str]) -> dict:
    """What ``run_in_fresh_process`` says of the life's ``/dev/shm`` (its doc), from the
    ``PRIVATE-SHM`` line that contracts/private_shm.py wrote first on the life's stderr."""
    status = next((x[len(MARKER):] for x in stderr.splitlines() if x.startswith(MARKER)),
                  "no: contracts/private_shm.py reported nothing")
    if status == "yes":
        return {"private": True}
    reason = status.removeprefix("no: ")
    left = sorted(_shm_entries() - before)
    print(f"engine life: no private /dev/shm ({reason}); removed nothing: left in place the {len(left)} "
          f"/dev/shm entries that appeared during it (some may be other programs'): {', '.join(left) or 'none'}; "
          "fix: run it as root, or where the kernel allows user namespaces (user.max_user_namespaces > 0; "
          "Debian: kernel.unprivileged_userns_clone=1; Ubuntu: kernel.apparmor_restrict_unprivileged_userns=0), "
          "or in Docker with --cap-add SYS_ADMIN; remove yourself what you know to be the engine's", file=sys.stderr, flush=True)
    return {"private": False, "reason": reason, "left": left}


def load_cfg(arg: str) -> dict:
    """A life's config from the command line: JSON, or ``@FILE`` holding it."""
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            return json.load(f)
    return json.loads(arg)


if __name__ == "__main__":
    result = run(load_cfg(sys.argv[1]))
    print(RESULT_MARKER + json.dumps(result), flush=True)
    os._exit(0)  # do not wait for stray non-daemon threads after the engine shut down
