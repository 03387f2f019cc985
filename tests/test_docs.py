"""The README's example and the demo keep working."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import demo

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


@pytest.mark.parametrize(
    ("index", "output"),
    [
        (0, "sent to user0@example.com\n20\n"),
        (1, "50\n50 0\n"),
        (2, "delivered 'hello' on attempt 3\n2\n"),
        (3, "['create 1', 'create 1', 'start 1']\n1\n"),
        (4, "1 invoice for order 42\n1\n"),
    ],
)
def test_readme_examples_run(index: int, output: str) -> None:
    """Each Python example in the README runs as written and prints what it shows."""
    result = subprocess.run(  # noqa: S603 - our own interpreter on our own README
        [sys.executable, "-c", EXAMPLES[index]],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout == output


def test_every_readme_example_is_tested() -> None:
    """No Python example in the README escapes the test above."""
    assert len(EXAMPLES) == 5


def test_readme_says_how_a_user_installs_each_extra() -> None:
    """The install block names this distribution, and only extras it has."""
    import importlib.metadata
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "trio-tickler"  # "tickler" on PyPI is another project
    section = README.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)\n```", section, flags=re.DOTALL)
    installs = [line.split("#")[0].split()[-1].strip("'") for line in block.splitlines()]
    assert installs == ["trio-tickler", "trio-tickler[postgres]", "trio-tickler[prometheus]"]
    extras = set(project["optional-dependencies"])
    installed = set(importlib.metadata.metadata("trio-tickler").get_all("Provides-Extra") or ())
    for name in installs[1:]:
        extra = name.split("[")[1].rstrip("]")
        assert extra in extras
        assert extra in installed
    assert "pip install '.[postgres,prometheus]'" in section


def test_readme_gives_the_two_setup_commands() -> None:
    """The README's commands are the ones .ci/run executes."""
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [
        block
        for block in re.findall(r"```sh\n(.*?)\n```", README)
        if block.startswith("python3 -m venv")
    ]
    assert commands[:2] == [
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python demo.py",
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest",
    ]
    ci_lines = ci.splitlines()
    for step in commands[1].split(" && "):  # CI runs the test command step by step
        assert step in ci_lines


async def test_demo_runs_the_dance(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The demo drains everything it sends and shows the limit being reached."""
    caplog.set_level("DEBUG", logger="tickler")
    stats = (await demo.main(capacity=3, requests=10, burst=8, seed=3)).statistics
    assert (stats.enqueued, stats.succeeded) == (18, 18)
    assert stats.peak_queued >= 5
    messages = [r.getMessage() for r in caplog.records if r.name == "tickler"]
    assert any(m.startswith("received loop signal, but request limit is reached") for m in messages)
    assert trio.current_time() < 10


def test_demo_arguments() -> None:
    """The demo takes --capacity, --requests, --burst and --seed."""
    args = demo.parse_args(["--capacity", "2", "--requests", "5", "--burst", "4", "--seed", "9"])
    assert (args.capacity, args.requests, args.burst, args.seed) == (2, 5, 4, 9)
    assert demo.parse_args([]).capacity == 3
