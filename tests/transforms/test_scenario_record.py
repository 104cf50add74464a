"""What the image's contract demands of every scenario module, checked here first.

The builder records ``testing.scenarios.<module>.run(options_on=True/False)`` on the host's
transformed tree, and ``contracts/test_scheduler_scenarios.py`` requires, in the image, the same
results and that the options change something. A new module whose result is the same both ways
fails there only after a whole image build; here it fails in the transform tests.
"""

import pytest

from testing.scenarios import modules

pytestmark = [pytest.mark.slow]

SCENARIO_CALLS = [("transformed", f"testing.scenarios.{name}", {"options_on": on})
                  for name in modules() for on in (True, False)]


@pytest.mark.parametrize("name", modules())
def test_the_options_change_what_the_scenario_records(scenario, name):
    module = f"testing.scenarios.{name}"
    assert scenario("transformed", module, options_on=True) != scenario("transformed", module, options_on=False), (
        f"testing/scenarios/{name}.py records the same result with its options on and off: the image's "
        "contract (contracts/test_scheduler_scenarios.py) refuses that; record what the options change")
