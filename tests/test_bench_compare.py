"""bench.compare: two revisions side by side, here HEAD against itself at tiny sizes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _head() -> str | None:
    if shutil.which("git") is None:
        return None
    done = subprocess.run(
        ["git", "rev-parse", "--verify", "HEAD"],  # noqa: S607 - the git on PATH
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def worktrees() -> set[str]:
    done = subprocess.run(
        ["git", "worktree", "list", "--porcelain"],  # noqa: S607 - the git on PATH
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {line for line in done.stdout.splitlines() if line.startswith("worktree ")}


@pytest.mark.skipif(_head() is None, reason="not in a git checkout with a commit")
def test_compare_runs_head_against_head_and_removes_its_worktrees() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.compare",
            "HEAD",
            "HEAD",
            "--rows",
            "burst,enqueue",
            "--rounds",
            "1",
            "--burst",
            "300",
            "--enqueue",
            "300",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(
            r"^\| (burst|enqueue) \(.*?\|.*?\|.*?\| ([\d.]+)x \|", done.stdout, re.M
        )
    }
    assert set(rows) == {"burst", "enqueue"}, done.stdout
    assert all(float(ratio) > 0 for ratio in rows.values())
    assert "the Trio pool" in done.stdout
    assert "a bare locked append" in done.stdout
    # Each round measured A, then B.
    assert re.findall(r"round 1/1 (\w+) ([AB])", done.stderr) == [
        ("burst", "A"),
        ("burst", "B"),
        ("enqueue", "A"),
        ("enqueue", "B"),
    ]
    # Its worktrees are gone (others', of a compare run beside it, may come and go).
    found = re.search(r"^worktrees in (\S+)$", done.stderr, re.M)
    assert found is not None, done.stderr
    directory = found[1]
    assert not Path(directory).exists()
    assert not [tree for tree in worktrees() if tree.startswith(f"worktree {directory}")]


def test_compare_refuses_an_unknown_row() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.compare", "HEAD", "HEAD", "--rows", "burst,nope"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--rows takes some of burst, enqueue, pg-drain" in done.stderr
