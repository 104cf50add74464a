import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transforms.trees import build_transformed_tree  # noqa: E402


@pytest.fixture(scope="session")
def transformed_tree(tmp_path_factory) -> Path:
    """The installed vLLM with every transform applied (hard-link copy)."""
    return build_transformed_tree(tmp_path_factory.mktemp("transformed") / "site")
