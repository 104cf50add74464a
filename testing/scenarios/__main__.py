"""Run scenarios in this interpreter, or record them both ways on a tree.

    python -m testing.scenarios < CALLS.json        each [module, kwargs] call's ``run``, here
    python -m testing.scenarios record TREE OUT     every scenario both ways against TREE (one more
                                                    interpreter), written to OUT as JSON
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from testing.scenarios import FILE_LINE, RESULT_LINE, modules, scenarios_both_ways


def main(argv: list[str]) -> None:
    if argv[:1] == ["record"]:
        tree, out = argv[1:]
        Path(out).write_text(json.dumps(scenarios_both_ways(Path(tree), modules())))
        return
    calls = json.loads(sys.stdin.read())
    import vllm.v1.core.sched.scheduler as scheduler

    print(FILE_LINE + scheduler.__file__, flush=True)
    for module, kwargs in calls:
        print(RESULT_LINE + json.dumps(importlib.import_module(module).run(**kwargs)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
