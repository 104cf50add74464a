"""One Reason enum for every store outcome: a misspelt reason is refused where it is made."""

import json

import pytest

from sparkcache.store import LookupResult, PublishResult, ReadResult, Reason
from sparkcache.store.manifests import ManifestError
from sparkcache.store.objects import ObjectError
from sparkcache.store.reasons import LOOKUP_MISSES, PUBLISH_FAILURES
from sparkcache.store.results import os_failure


@pytest.mark.parametrize(
    "make",
    [
        lambda r: LookupResult(0, None, r),
        lambda r: ReadResult(r),
        lambda r: PublishResult(False, r),
        lambda r: ObjectError(r, "ab" * 32, "detail"),
        lambda r: ManifestError(r, "detail"),
    ],
    ids=["LookupResult", "ReadResult", "PublishResult", "ObjectError", "ManifestError"],
)
def test_every_boundary_takes_a_reason_and_refuses_a_misspelt_one(make):
    made = make("no_space")  # its value is accepted and becomes the member
    assert made.reason is Reason.NO_SPACE
    with pytest.raises(ValueError, match="'no_spce' is not a valid Reason"):
        make("no_spce")


def test_a_reason_prints_and_serialises_as_its_metric_label():
    assert json.dumps({"reason": Reason.LOCK_TIMEOUT}) == '{"reason": "lock_timeout"}'
    assert f"publish_failed_{Reason.OVER_CAPACITY}" == "publish_failed_over_capacity"
    assert "publish_failed_" + Reason.OVER_CAPACITY == "publish_failed_over_capacity"
    assert str(ObjectError(Reason.CORRUPT, "ab" * 32, "bad")).startswith(f"object {'ab' * 32}: corrupt: bad")


def test_failures_and_misses_are_the_outcomes_that_are_not_success():
    assert Reason.HIT not in LOOKUP_MISSES and Reason.PUBLISHED not in PUBLISH_FAILURES
    assert set(PUBLISH_FAILURES) | set(LOOKUP_MISSES) | {Reason.HIT, Reason.PUBLISHED} == set(Reason)
    assert len(set(PUBLISH_FAILURES)) == len(PUBLISH_FAILURES) and len(set(LOOKUP_MISSES)) == len(LOOKUP_MISSES)


@pytest.mark.parametrize("errno_name, reason", [("ENOSPC", Reason.NO_SPACE), ("EDQUOT", Reason.NO_SPACE),
                                                ("EROFS", Reason.READ_ONLY_FS), ("EIO", Reason.IO_ERROR),
                                                ("EACCES", Reason.IO_ERROR)])
def test_an_os_error_maps_to_its_reason_with_the_fix(errno_name, reason):
    import errno
    import os

    code = getattr(errno, errno_name)
    got, detail = os_failure(OSError(code, os.strerror(code)))
    assert got is reason
    assert os.strerror(code) in detail and "; " in detail
