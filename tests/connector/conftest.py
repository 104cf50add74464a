import json
import os
import random
from pathlib import Path
from typing import Callable

import pytest

from contracts.engine_driver import run_in_fresh_process

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The offline tiny Llama (random weights, locally trained byte-level BPE)."""
    from testing.tinymodel import TINY, make_tiny_model

    return make_tiny_model(TINY)


@pytest.fixture(scope="session")
def hybrid_model() -> str:
    """The offline tiny NemotronH (Mamba2 + attention, long-memory SSM, fp32)."""
    from testing.tinymodel import make_tiny_hybrid

    return make_tiny_hybrid()


def long_prompt(n: int = 2100, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run_engine(cfg: dict, timeout: int = 500, env: dict | None = None,
               between: Callable[[int, list[dict]], None] | None = None) -> dict:
    """One engine life (start, generate, shut down) in a fresh process; returns its JSON.
    ``env``: added to the child's environment (its ``PYTHONPATH`` goes first). Unless ``cfg``
    says otherwise, eager (torch.compile does not change what the connector does and is slow on
    a CPU) and in one process (``"in_process"``: vLLM's engine core and worker import vLLM once
    instead of three times; docs/RESULTS.md, "Measurements behind the code"). The image's
    contract, the ``vllm serve`` tests and the tensor-parallel lives run vLLM's own processes
    and busy loop, compiled in the first two, as operators do. ``between``: for a life with
    ``"phases"`` (contracts/engine_driver.py), what to do before each phase after the first."""
    return run_in_fresh_process({"enforce_eager": True, "in_process": True, **cfg}, REPO, timeout, env=env,
                                between=between)


def metric(result: dict, name: str, **labels) -> float:
    total = 0.0
    for key, value in result["metrics"].items():
        mname, _, lab = key.partition("{")
        if mname != name:
            continue
        got = json.loads("{" + lab)
        if all(got.get(k) == v for k, v in labels.items()):
            total += value
    return total


def flip_byte(path, divisor: int = 2) -> bytes:
    """Flip the low bit of the byte at ``len // divisor`` of a stored file (made writable first:
    the store keeps its objects read-only); returns the file's new bytes."""
    data = bytearray(Path(path).read_bytes())
    data[len(data) // divisor] ^= 0x01
    os.chmod(path, 0o644)
    Path(path).write_bytes(bytes(data))
    return bytes(data)


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file and directory under ``root``: (mtime in ns, bytes or ``<dir>``)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (p.lstat().st_mtime_ns, p.read_bytes() if p.is_file() else b"<dir>")
    return out


def stored_entry(store, prompt: list[int], block_size: int, blocks: int, tp_rank: int = 0):
    """The one entry ``tp_rank`` published whose first ``blocks`` keys are ``prompt``'s."""
    from sparkcache.connector.keys import BlockKeys

    key = BlockKeys(block_size).upto(prompt, blocks)[-1]
    found = [e for e in store.entries() if e.manifest.identity.tp_rank == tp_rank
             and len(e.manifest.block_keys) >= blocks and e.manifest.block_keys[blocks - 1] == key]
    assert len(found) == 1, [(e.manifest.identity.tp_rank, len(e.manifest.block_keys)) for e in store.entries()]
    return found[0]


def cut_pages(pages: list[bytes], bpp: int, stored: int, blocks: int, layers: int) -> list[bytes]:
    """The first ``blocks`` of an entry's ``stored`` blocks, from its pages (``bpp`` blocks
    each, the last one short): a page holds each layer's blocks, layer after layer, so a page
    is cut layer by layer."""
    out = []
    for p, page in enumerate(pages):
        have, keep = min(bpp, stored - p * bpp), min(bpp, blocks - p * bpp)
        if keep <= 0:
            break
        if not layers:  # every layer windowed: pages of no bytes
            out.append(b"")
            continue
        per_layer = len(page) // layers
        block = per_layer // have
        out.append(b"".join(page[i * per_layer:i * per_layer + keep * block] for i in range(layers)))
    return out


def forge_entry(root, victim: list[int], donor: list[int], block_size: int, blocks: int, layers: int,
                zeroed: bool = False, zeroed_boundary: bool = False) -> None:
    """Publish, under the engine's identity, an entry keyed by ``victim``'s first ``blocks``
    blocks whose pages (and boundary object, when the donor's entry ends there) are ``donor``'s
    (zeros of the same sizes when ``zeroed``; ``zeroed_boundary``: the donor's pages and a
    boundary object of zeros the size of the donor entry's), through the
    store's own writer: what any writer of the root can do (the store checks bytes against
    their names, not what they mean)."""
    from sparkcache.connector.keys import BlockKeys
    from sparkcache.store import PageStore

    store = PageStore(str(root))
    m = stored_entry(store, donor, block_size, blocks).manifest
    pages = cut_pages([bytes(p) for p in store.read_pages(list(m.pages))], m.blocks_per_page,
                      len(m.block_keys), blocks, layers)
    # an entry ending with a boundary object (state, windows) at exactly that depth keeps it
    state = bytes(store.read_pages([m.state])[0]) if m.state is not None and len(m.block_keys) == blocks else None
    if zeroed_boundary:
        state = bytes(m.state.size)
    if zeroed:
        pages = [bytes(len(p)) for p in pages]
        state = None if state is None else bytes(len(state))
    result = store.publish(m.identity, BlockKeys(block_size).upto(victim, blocks), pages,
                           blocks_per_page=m.blocks_per_page, state=state)
    assert result.ok, result
    store.close()
