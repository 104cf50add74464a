"""``bench.restore_ttft``'s engine lives: what they tell vLLM. The bench prefills a prompt in
one step; vLLM's multiprocess executor kills a step that outlasts
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (``TimeoutError: RPC call to execute_model timed out``),
which a 64K-token prefill on two cores does at vLLM's default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.restore_ttft import life_env

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
