"""Run upstream vLLM 0.32.0's own tests (from the pinned sdist) and read each test's outcome.

Shared by the host suite (tests/upstream.py: the pristine and the transformed tree side by side)
and the contract suite inside an image (contracts/test_upstream.py: the image's tree against the
outcomes recorded for the transformed tree, contracts/expected/upstream-outcomes.json).

The sdist's ``tests/`` (with its ``pyproject.toml``) is copied to a scratch directory so that
its ``vllm/`` never shadows the installed package (the sdist's copy cannot detect the CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

EXPECTED = Path(__file__).resolve().parent / "expected" / "upstream-outcomes.json"

# Scheduler, prefix caching, hybrid/Mamba and connector lifecycle (DESIGN.md).
CI_SUBSET = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
)
FULL = ("tests/v1/core", "tests/v1/kv_connector/unit")
# What an image's contract suite runs by default: the tests of the functions the transforms change
# (scheduler, single-type managers, Mamba align) and the connector lifecycle; the CI subset without
# upstream's prefix-caching and offloading-connector tests, which take most of its time
# (docs/RESULTS.md, "Measurements behind the code").
IMAGE_SUBSET = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
)

# What the host suite runs (tests/test_upstream_unchanged.py): the rest of the CI subset. In
# `make test` the image lane runs IMAGE_SUBSET inside the image it built, whose transformed files the
# contract proves equal to the lock's postimages (the bytes the host applies), so the CI subset runs
# on the transformed source once; `python -m tests.upstream` runs all of it on both trees.
HOST_SUBSET = tuple(p for p in CI_SUBSET if p not in IMAGE_SUBSET)

# Upstream's scheduler helpers name facebook/opt-125m; its config.json (architecture numbers only,
# no weights, no tokenizer) is written into an offline Hugging Face cache so ModelConfig resolves.
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "activation_function": "relu",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
}


@dataclass(frozen=True)
class UpstreamRun:
    tree: str
    outcomes: dict[str, str]  # test id -> passed / failed / error / skipped

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)

    def summary(self) -> str:
        return ", ".join(f"{self.count(o)} {o}" for o in ("passed", "failed", "error", "skipped"))


def scratch_copy(sdist_root: Path, dest: Path) -> Path:
    """dest gets the sdist's tests/, pyproject.toml and examples/, but never its vllm/."""
    if not (sdist_root / "tests").is_dir():
        raise FileNotFoundError(f"{sdist_root}/tests not found: run `python -m transforms fetch --dest {sdist_root.parent}`")
    shutil.copytree(sdist_root / "tests", dest / "tests")
    shutil.copy2(sdist_root / "pyproject.toml", dest / "pyproject.toml")
    if (sdist_root / "examples").is_dir():
        shutil.copytree(sdist_root / "examples", dest / "examples")
    offline_hf_home(dest / "hf-home")
    return dest


def offline_hf_home(dest: Path) -> Path:
    """An HF_HOME whose hub cache holds facebook/opt-125m's config.json and nothing else."""
    repo = dest / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    (repo / "snapshots" / revision).mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    return dest


def _outcomes(junit: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "error" in kinds:
            outcome = "error"
        elif "failure" in kinds:
            outcome = "failed"
        elif "skipped" in kinds:
            outcome = "skipped"
        else:
            outcome = "passed"
        # A test that passed but errored in teardown is recorded twice; keep the worst.
        if outcomes.get(test_id) not in ("error", "failed"):
            outcomes[test_id] = outcome
    return outcomes


def run_pytest(label: str, scratch: Path, paths: tuple[str, ...], env: dict[str, str], timeout: int) -> UpstreamRun:
    """pytest on ``paths`` in ``scratch`` (made by scratch_copy) with ``env``'s vLLM; one outcome per test id."""
    junit = scratch / f"junit-{label}.xml"
    env = dict(env, HF_HOME=str(scratch / "hf-home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(scratch), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # Modules that import a missing accelerator library fail to collect on both trees; run the rest.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junitxml={junit}", *paths]
    print(f"upstream[{label}]: {' '.join(paths)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    if not junit.exists():
        raise RuntimeError(f"upstream tests on {label} produced no report (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    run = UpstreamRun(label, _outcomes(junit))
    print(f"upstream[{label}]: {run.summary()}", file=sys.stderr, flush=True)
    return run


def compare(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Test ids whose outcome differs (including ids present on one side only)."""
    return sorted(i for i in set(expected) | set(got) if expected.get(i) != got.get(i))


def in_scope(test_id: str, paths: tuple[str, ...]) -> bool:
    """Whether a JUnit test id (``tests.v1.core.test_x::name``) lies under one of ``paths``."""
    classname, _, name = test_id.partition("::")
    module = (classname or name).replace(".", "/")  # a module that failed to collect has no class name
    stems = [p.removesuffix(".py").rstrip("/") for p in paths]
    return any(module == s or module.startswith(s + "/") for s in stems)


def expected_outcomes(paths: tuple[str, ...]) -> dict[str, str]:
    """The transformed tree's recorded outcomes for the tests under ``paths``."""
    recorded = json.loads(EXPECTED.read_text())["transformed"]
    return {i: o for i, o in recorded.items() if in_scope(i, paths)}
