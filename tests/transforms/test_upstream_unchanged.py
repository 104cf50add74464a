"""Upstream vLLM 0.32.0's own tests give the same outcome, test by test, on the transformed tree.

The transforms are opt-in, so with their options absent the transformed tree
must behave exactly like the pristine one. Runs the CI subset (scheduler,
prefix caching, hybrid/Mamba, connector lifecycle); `make test-upstream-full`
runs all of tests/v1/core and tests/v1/kv_connector/unit. Failures on both
trees are environment-only and listed in docs/RUNTIME_CONTRACT.md.

Both runs must also equal the outcomes recorded in contracts/expected/upstream-outcomes.json,
which the contract suite holds an image's tree to: the record cannot go stale unnoticed.
"""

import pytest
from upstream import CI_SUBSET, compare, run_both

from contracts.upstream import expected_outcomes

pytestmark = [pytest.mark.slow]


def test_upstream_subset_same_outcomes_on_both_trees(tmp_path):
    pristine, transformed = run_both(CI_SUBSET, tmp_path)
    print(f"pristine: {pristine.summary()}\ntransformed: {transformed.summary()}")
    assert pristine.count("passed") > 500, pristine.summary()
    assert compare(pristine.outcomes, transformed.outcomes) == []
    assert compare(expected_outcomes(CI_SUBSET), transformed.outcomes) == [], "rerun `python -m tests.upstream --full --record`"
