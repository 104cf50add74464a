"""Upstream vLLM 0.32.0's own tests give the same outcome, test by test, on the transformed tree.

The transforms are opt-in, so with their options absent the transformed tree must behave
exactly like the pristine one. contracts/expected/upstream-outcomes.json records every test's
outcome from `python -m tests.upstream --full --record`, which ran both trees and found no test
whose outcome differs (its ``pristine_where_different`` is empty); failures on both trees are
environment-only and listed in docs/RUNTIME_CONTRACT.md. The image contract suite holds an
image's tree to the same record.

Here the transformed tree runs the part of the CI subset that the image's contract does not
(``HOST_SUBSET``: prefix caching, partial prefix hits, the offloading connector's scheduler; in
`make test` the image lane runs ``IMAGE_SUBSET``, the scheduler, single-type manager, Mamba-align and
connector-lifecycle tests, in the image it built, on the same transformed bytes) and must give the
recorded outcome for every test. Only when it does not does the
pristine tree run too, to say whether the transforms or the environment changed the outcome.
"""

import json

import pytest
from upstream import EXPECTED, compare, run_tree

from contracts.upstream import HOST_SUBSET, expected_outcomes

pytestmark = [pytest.mark.slow]


def test_upstream_subset_same_outcomes_on_both_trees(tmp_path):
    assert json.loads(EXPECTED.read_text())["pristine_where_different"] == {}, "the record shows the transforms change an outcome"
    recorded = expected_outcomes(HOST_SUBSET)
    transformed = run_tree("transformed", HOST_SUBSET, tmp_path)
    print(f"transformed: {transformed.summary()}")
    assert transformed.count("passed") > 500, transformed.summary()
    differ = compare(recorded, transformed.outcomes)
    if not differ:
        return
    pristine = run_tree("pristine", HOST_SUBSET, tmp_path)
    rows = [f"  {i}: recorded {recorded.get(i)}, pristine {pristine.outcomes.get(i)}, transformed {transformed.outcomes.get(i)}" for i in differ]
    cause = (
        "the transforms change these outcomes (pristine and transformed differ)"
        if compare(pristine.outcomes, transformed.outcomes)
        else "both trees differ from the record alike: the environment changed; rerun `python -m tests.upstream --full --record`"
    )
    pytest.fail(f"{len(differ)} upstream outcomes differ from {EXPECTED.name}: {cause}\n" + "\n".join(rows[:40]))
