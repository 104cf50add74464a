"""Upstream vLLM 0.32.0's own tests give, in the image, the outcomes recorded for the transformed tree.

The builder bakes the sdist's tests/ (with an offline Hugging Face cache holding only
facebook/opt-125m's config.json) under /opt/sparkcache/upstream; the record is
contracts/expected/upstream-outcomes.json, which the host suite keeps true. Scopes
(SPARKCACHE_UPSTREAM_SCOPE, `python build.py verify REF --upstream SCOPE`): `image` (default: the
tests of the functions the transforms change and the connector lifecycle), `ci` (the whole CI
subset), `full` (tests/v1/core and tests/v1/kv_connector/unit whole).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from contracts.upstream import CI_SUBSET, FULL, IMAGE_SUBSET, compare, expected_outcomes, run_pytest

BAKED = Path("/opt/sparkcache/upstream")


def test_upstream_outcomes_match_the_record(tmp_path):
    scope = os.environ.get("SPARKCACHE_UPSTREAM_SCOPE", "image")
    paths = {"image": IMAGE_SUBSET, "ci": CI_SUBSET, "full": FULL}[scope]
    scratch = Path(shutil.copytree(BAKED, tmp_path / "upstream"))
    expected = expected_outcomes(paths)
    run = run_pytest("image", scratch, paths, dict(os.environ, PYTHONPATH=""), timeout=3 * 3600)
    print(f"image: {run.summary()}; recorded for the transformed tree: {len(expected)} tests")
    assert expected and run.count("passed") > 0
    assert compare(expected, run.outcomes) == []
