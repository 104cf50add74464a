"""The builder's view of the checkout it reads: a change under the overlay's sources while a build runs
must be seen (the image would otherwise carry files its revision label does not name)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from images.builder.pipeline import worktree_state


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t", *args], cwd=root, check=True, capture_output=True)


def test_state_follows_what_the_overlay_reads(tmp_path):
    root = tmp_path / "checkout"
    (root / "sparkcache").mkdir(parents=True)
    (root / "contracts").mkdir()
    (root / "sparkcache" / "a.py").write_text("A = 1\n")
    (root / "contracts" / "test_x.py").write_text("def test_x(): pass\n")
    (root / ".gitignore").write_text("*.log\n")
    (root / "README.md").write_text("readme\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "one")
    clean = worktree_state(root)
    assert clean is not None and worktree_state(root) == clean

    (root / "sparkcache" / "a.py").write_text("A = 2\n")           # a tracked source edited
    edited = worktree_state(root)
    assert edited != clean
    (root / "sparkcache" / "a.py").write_text("A = 3\n")           # edited again: still another state
    assert worktree_state(root) not in (clean, edited)
    (root / "sparkcache" / "a.py").write_text("A = 1\n")
    assert worktree_state(root) == clean

    (root / "contracts" / "test_new.py").write_text("x = 1\n")     # an untracked file the overlay would bake in
    untracked = worktree_state(root)
    assert untracked != clean
    (root / "contracts" / "test_new.py").write_text("x = 2\n")     # its bytes count, not only its name
    assert worktree_state(root) != untracked
    (root / "contracts" / "test_new.py").unlink()
    assert worktree_state(root) == clean

    (root / "README.md").write_text("edited\n")                    # outside the overlay's sources
    (root / "contracts" / "run.log").write_text("ignored\n")       # ignored by git
    assert worktree_state(root) == clean

    git(root, "commit", "-q", "-am", "two")                        # a new HEAD is a new state
    assert worktree_state(root) != clean
    plain = tmp_path / "plain"
    plain.mkdir()
    assert worktree_state(plain) is None                               # outside a git checkout
