"""Clock steps for the store's property suites (test_clock_properties.py,
test_fault_properties.py): the wall-clock offsets a process is drawn, the steps of time and
of the filesystem's clock, a process's wall clock moved, and every mtime under a directory
moved (what the filesystem's clock moving on looks like to the files stamped before)."""

from __future__ import annotations

import os
import time
from unittest import mock

from hypothesis import strategies as st

REAL_TIME = time.time  # the kernel's wall clock, whatever a test patches in its place
YEARS_10 = 10 * 365.25 * 86400.0
# a process's wall clock off the filesystem's: 2 minutes, an hour or 10 years either way
WALLS = st.sampled_from([-YEARS_10, -3600.0, -120.0, 0.0, 120.0, 3600.0, YEARS_10])
# true time passing (seconds), and the filesystem's clock stepping
TIME_STEPS = st.sampled_from([1.0, 20.0, 45.0, 80.0, 110.0, 250.0])
FS_STEPS = st.sampled_from([-YEARS_10, -3600.0, -120.0, 120.0, 3600.0, YEARS_10])


def as_wall(offset: float):
    """This process's wall clock (``time.time``) ``offset`` seconds off the kernel's while
    the context lasts (its threads included)."""
    return mock.patch.object(time, "time", lambda: REAL_TIME() + offset)


def shift_mtimes(top: str, seconds: float) -> None:
    """Every file and directory under ``top`` (links themselves, not followed) stamped
    ``seconds`` earlier: to them, the filesystem's clock moved on by ``seconds``."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st_ = os.lstat(path)
            os.utime(path, (st_.st_atime - seconds, st_.st_mtime - seconds), follow_symlinks=False)
