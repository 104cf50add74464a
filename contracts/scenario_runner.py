"""Run one transforms.scenarios module both ways and print its results as one JSON line.

    python contracts/scenario_runner.py transforms.scenarios.lease_accounting

Used inside the image by the contract suite, and by the builder on the host to record what the
same scenarios give on the tested transformed tree (the suite then requires the image to agree).
"""

import importlib
import json
import sys

if __name__ == "__main__":
    module = importlib.import_module(sys.argv[1])
    result = {"options_on": module.run(options_on=True), "options_off": module.run(options_on=False)}
    print("SCENARIO-RESULT " + json.dumps(result, sort_keys=True))
