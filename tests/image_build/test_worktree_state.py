"""The builder's view of the checkout an image is made from: every file the overlay or the sparkcache
wheel takes counts (tracked, untracked or git-ignored alike), caches and hidden folders do not, and a
revision is '-dirty' whenever those files are not exactly HEAD's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from images.builder import layers
from images.builder.pipeline import revision_of, source_files, worktree_state


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path) -> Path:
    root = tmp_path / "checkout"
    for d in ("sparkcache", "transforms", "contracts"):
        (root / d).mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "sparkcache" / "a.py").write_text("A = 1\n")
    (root / "contracts" / "test_x.py").write_text("def test_x(): pass\n")
    (root / ".gitignore").write_text("*.log\n__pycache__/\n.pytest_cache/\n")
    (root / "README.md").write_text("readme\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "one")
    return root


def test_the_state_is_the_bytes_the_image_is_made_from(checkout):
    root = checkout
    clean = worktree_state(root)
    head = revision_of(root)
    assert worktree_state(root) == clean and not head.endswith("-dirty")

    (root / "sparkcache" / "a.py").write_text("A = 2\n")           # a tracked source edited
    edited = worktree_state(root)
    assert edited != clean and revision_of(root) == head + "-dirty"
    (root / "sparkcache" / "a.py").write_text("A = 3\n")           # edited again: another state
    assert worktree_state(root) not in (clean, edited)
    (root / "sparkcache" / "a.py").write_text("A = 1\n")
    assert worktree_state(root) == clean and revision_of(root) == head

    for stray in ("contracts/test_new.py", "contracts/run.log"):    # untracked, and git-ignored: both baked
        (root / stray).write_text("x = 1\n")
        assert worktree_state(root) != clean and revision_of(root) == head + "-dirty", stray
        (root / stray).unlink()
    assert worktree_state(root) == clean

    for cache in ("contracts/__pycache__/x.cpython-311.pyc", "contracts/.pytest_cache/README.md", "transforms/.hidden"):
        (root / cache).parent.mkdir(exist_ok=True)
        (root / cache).write_text("not baked\n")                    # never in the image
    assert worktree_state(root) == clean and revision_of(root) == head
    assert not any(".pytest_cache" in str(p) or "__pycache__" in str(p) for p in source_files(root))

    (root / "README.md").write_text("edited\n")                    # not an image input
    assert worktree_state(root) == clean

    spec = root / "spec.yaml"                                       # what build() adds: the spec, the template
    spec.write_text("name: a\n")
    at_start = worktree_state(root, extra=(spec,))
    spec.write_text("name: b\n")
    assert worktree_state(root, extra=(spec,)) != at_start


def test_a_new_head_is_a_new_state(checkout):
    clean = worktree_state(checkout)
    (checkout / "README.md").write_text("edited\n")
    git(checkout, "commit", "-q", "-am", "two")
    assert worktree_state(checkout) != clean


def test_outside_git_the_files_still_count(tmp_path, checkout):
    plain = tmp_path / "plain"
    for p in source_files(checkout):
        dest = plain / p.relative_to(checkout)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(p.read_bytes())
    state = worktree_state(plain)
    assert revision_of(plain) == "uncommitted"
    (plain / "contracts" / "test_x.py").write_text("changed\n")
    assert worktree_state(plain) != state


def test_the_overlay_and_the_state_take_the_same_files(checkout):
    (checkout / "contracts" / ".pytest_cache").mkdir()
    (checkout / "contracts" / ".pytest_cache" / "v").write_text("cache\n")
    (checkout / "contracts" / "data.json").write_text("{}\n")
    baked = {path for path, _, _ in layers.tree_files(checkout / "contracts", "/c")}
    assert baked == {"/c/test_x.py", "/c/data.json"}
    assert {p for p in source_files(checkout) if "contracts" in p.parts} == {checkout / "contracts" / "test_x.py",
                                                                           checkout / "contracts" / "data.json"}
