"""Does a publication in the model's process slow a prefill forward, and does the connector's
prefill hold take that back?

    python -m bench.prefill_hold --out bench-out/prefill_hold [--rounds 40] [--prompt-tokens 256]

One process, as vLLM's CPU worker is one: the bench model (``testing.tinymodel.BENCH``, through
transformers, bf16, one torch thread) on a thread held to one CPU, as vLLM pins its model's
thread, and a publisher thread placed as the connector's is (``cpus.run_as_publisher``: off the
model's CPU, at the publisher's niceness), the interpreter's switch interval the writing
worker's (``worker_side.GIL_SWITCH_INTERVAL_S``). The publisher publishes entries of fresh
random pages into a real store (``PageStore.publish``, the worker's pace argument). Each round
times one forward of a ``--prompt-tokens`` prompt in each of three modes, in turn:

- ``idle``: the publisher does nothing;
- ``publishing``: it publishes throughout the forward;
- ``held``: it publishes, and the forward is a prefill step's: ``PrefillHold.step`` before it,
  ``step_done`` after, as the connector calls them; the publisher waits in its pace.

Writes DIR/prefill_hold.json (every forward's seconds, medians, ratios to idle) and
DIR/prefill_hold.png. Machines are noisy: the modes alternate within each round, and the
ratios are of medians over the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("idle", "publishing", "held")
PAGE_BYTES = 4 << 20  # a page of the bench model: 16 blocks of 32 tokens at 8 KiB per token
PAGES = 2


class _Publisher:
    """A thread publishing entries of fresh pages while ``busy`` is set, each page after
    ``hold.wait()`` (the worker's pace)."""

    def __init__(self, store, hold) -> None:
        from sparkcache.store import Identity

        self.store, self.hold = store, hold
        self.identity = Identity("prefill-hold-bench", "bytes", 32, 0, "untransformed")
        self.busy = threading.Event()
        self.published = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="bench-publisher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from sparkcache.store import cpus

        cpus.run_as_publisher()
        n = 0
        while not self._stop:
            if not self.busy.wait(0.05):
                continue
            n += 1
            pages = [os.urandom(PAGE_BYTES) for _ in range(PAGES)]
            keys = [f"bench-{os.getpid()}-{n}-{b}" for b in range(PAGES * 16)]
            if self.store.publish(self.identity, keys, pages, pace=self.hold.wait).ok:
                self.published += 1

    def stop(self) -> None:
        self._stop = True
        self.busy.set()
        self._thread.join(30)


def run(rounds: int, prompt_tokens: int, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from sparkcache.connector.prefill_hold import PrefillHold
    from sparkcache.connector.worker_side import GIL_SWITCH_INTERVAL_S
    from sparkcache.store import PageStore, cpus
    from testing.tinymodel import BENCH, make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(BENCH), dtype=torch.bfloat16).eval()
    model_cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {model_cpu})  # as vLLM pins its model's thread
    torch.set_num_threads(1)
    cpus.note_model_cpus("")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    store = PageStore(str(work / "store"), max_bytes=8 << 30, low_watermark_bytes=6 << 30, page_blocks=16)
    hold = PrefillHold()
    publisher = _Publisher(store, hold)
    prompt = torch.randint(3, 1000, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        with torch.no_grad():
            for _ in range(3):
                model(prompt)
            for _ in range(rounds):
                for mode in MODES:
                    (publisher.busy.set if mode != "idle" else publisher.busy.clear)()
                    time.sleep(0.05)  # the publisher running (or idle) before the forward starts
                    hold.step(prompt_tokens - 1 if mode == "held" else 0)
                    t = time.perf_counter()
                    model(prompt)
                    seconds[mode].append(time.perf_counter() - t)
                    hold.step_done()
        publisher.busy.clear()
    finally:
        publisher.stop()
    medians = {m: statistics.median(v) for m, v in seconds.items()}
    return {"bench": "prefill_hold", "rounds": rounds, "prompt_tokens": prompt_tokens,
            "model_cpu": model_cpu, "cpus": os.cpu_count(), "publications": publisher.published,
            "held_s": hold.held_s, "median_s": medians,
            "over_idle": {m: medians[m] / medians["idle"] for m in MODES}, "seconds": seconds}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([[s * 1e3 for s in result["seconds"][m]] for m in MODES], tick_labels=list(MODES))
    ax.set_ylabel("prefill forward, ms")
    ax.set_title(f"{result['prompt_tokens']}-token prefill beside a publisher ({result['rounds']} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_hold", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "prefill_hold")
    p.add_argument("--rounds", type=int, default=40, help="forwards per mode, the modes in turn")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the prefill's length")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.prompt_tokens < 2:
        raise SystemExit("--rounds at least 1, --prompt-tokens at least 2")
    import shutil

    work = Path(tempfile.mkdtemp(prefix="prefill_hold-"))
    try:
        result = run(args.rounds, args.prompt_tokens, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_hold.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "prefill_hold.png")
    print("  ".join(f"{m} {result['median_s'][m] * 1e3:.1f} ms ({result['over_idle'][m]:.3f})" for m in MODES)
          + f"; {result['publications']} publications")
    print(f"wrote {args.out / 'prefill_hold.json'} and {args.out / 'prefill_hold.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
