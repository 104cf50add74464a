"""python -m transforms.scenarios < CALLS.json: run each [module, kwargs] call's ``run`` in this interpreter."""

from __future__ import annotations

import importlib
import json
import sys

from transforms.scenarios import FILE_LINE, RESULT_LINE


def main() -> None:
    calls = json.loads(sys.stdin.read())
    import vllm.v1.core.sched.scheduler as scheduler

    print(FILE_LINE + scheduler.__file__, flush=True)
    for module, kwargs in calls:
        print(RESULT_LINE + json.dumps(importlib.import_module(module).run(**kwargs)), flush=True)


if __name__ == "__main__":
    main()
