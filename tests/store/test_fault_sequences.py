"""Falsifying sequences of ``test_fault_properties.py``'s state machine, replayed step by step
(deterministic, seconds instead of a search). Needs root (FUSE)."""

from __future__ import annotations

import pytest

from clock_helpers import YEARS_10
from faultfs import FaultFS
from test_fault_properties import FaultsAndClocks, Fault

pytestmark = pytest.mark.root  # FUSE mounts need root


@pytest.fixture(scope="module")
def faultfs(tmp_path_factory):
    with FaultFS(tmp_path_factory.mktemp("fault-sequences")) as mounted:
        yield mounted


def _steps(state: FaultsAndClocks, steps) -> None:
    try:
        for name, kw in steps:
            getattr(state, name)(**kw)
            state.disk_holds_the_model()
    finally:
        state.teardown()


def test_a_failed_publication_after_a_clock_step_loses_no_object_to_a_sweep(faultfs):
    """A publication that fails with a fault armed, decades after its objects' mtimes, then a
    pass with an orphan sweep: no manifest on disk may name an object the sweep deleted."""
    back = -YEARS_10
    _steps(FaultsAndClocks(faultfs), [
        ("published", dict(lengths=[4, 4, 4])),
        ("filesystem_clock_steps", dict(s=back)),
        ("live_publication", dict(fault=Fault("removed while open", "flush", "EACCES", 1, 2))),
        ("live_publication", dict(fault=None)),
        ("live_publication", dict(fault=Fault("gc.lock", "open", "EACCES", 1, 2))),
        ("filesystem_clock_steps", dict(s=back)),
        ("live_publication", dict(fault=None)),
        ("filesystem_clock_steps", dict(s=back)),
        ("publish", dict(conv=1, fault=None, n=6, wall=back)),
        ("filesystem_clock_steps", dict(s=back)),
        ("filesystem_clock_steps", dict(s=back)),
        ("filesystem_clock_steps", dict(s=back)),
        ("new_writer", dict(fault=None, wall=back, which="R")),
        ("maintenance_pass", dict(fault=None, pressure=False, sweep=True, wall=back)),
        ("fetch", dict(conv=1, fault=None, n=4, wall=back)),
    ])



def test_a_failed_publication_then_a_new_writer_and_a_sweep_lose_nothing(faultfs):
    """The same loss, as the search shrank it on a later commit: the reader's open removes
    the failed publication's intent while a close fails there."""
    back = -YEARS_10
    _steps(FaultsAndClocks(faultfs), [
        ("published", dict(lengths=[4, 4, 4])),
        ("filesystem_clock_steps", dict(s=back)),
        ("live_publication", dict(fault=Fault("removed while open", "flush", "EACCES", 1, 2))),
        ("filesystem_clock_steps", dict(s=-120.0)),
        ("live_publication", dict(fault=None)),
        ("live_publication", dict(fault=None)),
        ("release", dict(fault=None, which=0)),
        ("live_publication", dict(fault=Fault("gc.lock", "open", "EACCES", 1, 2))),
        ("publish", dict(conv=1, fault=None, n=6, wall=back)),
        ("new_writer", dict(fault=None, wall=back, which="R")),
        ("faults_cleared", dict()),
        ("maintenance_pass", dict(fault=None, pressure=False, sweep=True, wall=back)),
    ])
