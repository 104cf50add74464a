"""``bench.restore_ttft``'s engine lives: what they tell vLLM, and what the capturing life's
step target needs. The bench prefills a prompt in one step; vLLM's multiprocess executor kills
a step that outlasts ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (``TimeoutError: RPC call to
execute_model timed out``), which a 64K-token prefill on two cores does at vLLM's default. A
storing life of one prompt used to end before its capture's steps reached the metrics, and
the step target then passed on no step at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.restore_ttft import life_env, median_step_at_most, step_quantiles

REPO = Path(__file__).resolve().parents[2]

# vLLM 0.32.0's own envs module reads the bound, with the life's environment and without it
_READ = """import json, os, sys
import vllm.envs as e
given = e.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
for name in json.loads(sys.argv[1]):
    del os.environ[name]
print(json.dumps([given, e.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS]))"""


def test_one_step_of_a_life_may_take_as_long_as_the_whole_life():
    env = life_env(7200)
    done = subprocess.run([sys.executable, "-c", _READ, json.dumps(list(env))], env={**os.environ, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    given, default = json.loads(done.stdout.strip().splitlines()[-1])
    assert given == 7200
    assert default < 7200  # vLLM's own default is shorter than a long life: the bench must set it


def test_the_capture_step_target_is_not_met_where_no_step_was_observed():
    assert not median_step_at_most(step_quantiles({}), 0.001)  # a storing life whose steps never reached the metrics
    quick = {"0.0005": 9, "0.001": 10, "0.01": 11, "+Inf": 11}  # cumulative, as vLLM's histogram buckets
    slow = {"0.0005": 1, "0.001": 2, "0.01": 11, "+Inf": 11}
    assert median_step_at_most(step_quantiles(quick), 0.001)
    assert not median_step_at_most(step_quantiles(slow), 0.001)
