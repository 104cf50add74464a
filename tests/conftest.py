import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transforms.trees import build_transformed_tree  # noqa: E402


@pytest.fixture(scope="session")
def transformed_tree(tmp_path_factory) -> Path:
    """The installed vLLM with every transform applied (hard-link copy)."""
    return build_transformed_tree(tmp_path_factory.mktemp("transformed") / "site")


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """One real S3 server for the session (testing/seaweedfs.py: ``weed mini`` on 127.0.0.1,
    ready when a probe object was put and read back). Fails, with the fix, when `weed` is not
    installed (`make test` installs it): a missing server is a failure, never a skip."""
    from testing.seaweedfs import SeaweedFS

    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
