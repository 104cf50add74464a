"""Shared helpers for the store tests: identities, deterministic page contents, the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from sparkcache.store import Identity, PageStore

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IDENT = Identity("tiny-llama", "fp16:L2:H4:D32", 16, 0, "lock-abc")


def stopped_clock() -> float:
    """A clock for ``run_pass(timer=)`` that never advances: the pass then stops on its work
    and its entry and byte budgets only, never on time, however busy the machine (a test whose
    subject is not pacing; test_pacing.py tests the pacing)."""
    return 0.0


def conv_keys(conv: int, n: int) -> list[str]:
    """Chained block hashes of conversation ``conv`` (a linear chain, so position-unique)."""
    return [f"c{conv}-b{i}" for i in range(n)]


def page_bytes(conv: int, page: int, blocks_in_page: int, size_per_block: int = 256) -> bytes:
    """Deterministic contents of one page; the tail page changes as it fills."""
    seed = hashlib.sha256(f"{conv}:{page}:{blocks_in_page}".encode()).digest()
    return (seed * (size_per_block * blocks_in_page // 32 + 1))[: size_per_block * blocks_in_page]


def flip_bit(path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` of the file at ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def conv_pages(conv: int, n_blocks: int, bpp: int, size_per_block: int = 256) -> list[bytes]:
    out = []
    for p in range(-(-n_blocks // bpp)):
        out.append(page_bytes(conv, p, min(bpp, n_blocks - p * bpp), size_per_block))
    return out


# open_store's cap. Every writer of a root uses one cap (PageStore refuses another while a
# writer with this one is alive): a CLI writer (gc) beside open_store's writers passes
# ``"--config", CLI_CAP``.
CAP = {"max_bytes": 1 << 30, "low_watermark_bytes": 1 << 29}
CLI_CAP = json.dumps({"max_bytes": "1GiB", "low_watermark_bytes": "512MiB"})


def open_store(root: str, **kw) -> PageStore:
    kw.setdefault("page_blocks", 4)
    for key, value in CAP.items():
        kw.setdefault(key, value)
    return PageStore(str(root), **kw)


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")}
    full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "sparkcache", *args], capture_output=True,
                          text=True, env=full_env, cwd=REPO_ROOT, timeout=120)


def all_store_files(store: PageStore) -> list[str]:
    """Every object and manifest file of the store."""
    out = []
    for top in (store.layout.objects_dir, store.layout.manifests_dir):
        for dirpath, _, files in os.walk(top):
            out += [os.path.join(dirpath, f) for f in files]
    return sorted(out)
