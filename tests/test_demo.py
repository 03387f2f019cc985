"""demo.py: its request numbers are tickler's, and it ends with a measured summary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio

import demo

ROOT = Path(__file__).parent.parent


async def test_request_numbers_are_ticket_ids(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The demo's request-N is tickler's request #N, in the burst too."""
    caplog.set_level("DEBUG")
    outcome = await demo.main(capacity=3, requests=5, burst=3, seed=1)
    assert (outcome.statistics.enqueued, outcome.statistics.succeeded) == (8, 8)
    messages = [r.getMessage() for r in caplog.records if r.name in ("tickler", "demo")]
    added = [int(n) for m in messages for n in re.findall(r"^request #(\d+) added", m)]
    assert added == list(range(1, 9))
    done = {int(n): m for m in messages for n in re.findall(r"^request-(\d+) done", m)}
    assert sorted(done) == list(range(1, 9))
    assert sorted(n for n, m in done.items() if m.endswith(" (burst)")) == [6, 7, 8]
    for number in range(1, 9):
        # The demo's handler finishes request-N only after tickler starts request #N.
        started = messages.index(f"processing request #{number} (attempt 1)")
        assert started < messages.index(done[number])
    assert "phase 1: 5 requests (request-1 to request-5) at random 0-100 ms intervals" in messages
    assert "phase 2: a burst of 3 requests (request-6 to request-8) with no delay" in messages


@pytest.mark.parametrize("capacity", [1, 2, 4])
async def test_most_at_once_is_measured(autojump_clock: trio.abc.Clock, capacity: int) -> None:
    """The handler counts its concurrent runs; the burst fills every slot, never more."""
    outcome = await demo.main(capacity=capacity, requests=3, burst=10, seed=2)
    assert outcome.most_at_once == capacity


async def test_summary_line(autojump_clock: trio.abc.Clock) -> None:
    outcome = await demo.main(capacity=3, requests=10, burst=8, seed=3)
    peak = outcome.statistics.peak_queued
    assert (
        demo.summary(outcome)
        == f"18 requests, never more than 3 at once, up to {peak} waiting, none lost"
    )
    lost = attrs.evolve(outcome, statistics=attrs.evolve(outcome.statistics, succeeded=15))
    assert demo.summary(lost).endswith(", 3 not completed")
    one = attrs.evolve(
        outcome, statistics=attrs.evolve(outcome.statistics, enqueued=1, succeeded=1)
    )
    assert demo.summary(one).startswith("1 request, ")


async def test_report_shows_timings_readably(autojump_clock: trio.abc.Clock) -> None:
    """The timings read as sentences; without histograms the report says nothing of them."""
    outcome = await demo.main(capacity=2, requests=4, burst=4, seed=5)
    text = demo.report(outcome)
    assert re.search(r"wait_time: 8 requests waited [\d.]+ m?s on average, none longer than", text)
    assert re.search(
        r"run_time: 8 attempts ran [\d.]+ ms on average, none longer than 500 ms", text
    )
    assert "histograms" not in text  # recorded by default: the demo no longer asks for them
    assert "None" not in text
    assert text.splitlines()[-1] == demo.summary(outcome)


def test_demo_script_output() -> None:
    """python demo.py: numbered log lines, readable timings, one summary line last."""
    result = subprocess.run(
        [sys.executable, "demo.py", "--requests", "5", "--burst", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    lines = result.stdout.splitlines()
    assert re.fullmatch(
        r"8 requests, never more than 3 at once, up to \d+ waiting, none lost", lines[-1]
    )
    assert not [line for line in lines if re.search(r":\s*None\s*$", line)]
    assert any(re.search(r"wait_time: 8 requests waited", line) for line in lines)
    assert any(re.search(r"run_time: 8 attempts ran", line) for line in lines)
    assert any(line.endswith("tickler request #1 added, queue length now 1") for line in lines)
    assert any(line.endswith("demo    request-1 done") for line in lines)
    assert any(line.endswith("demo    request-8 done (burst)") for line in lines)
    assert not any("request-0" in line or "burst-" in line for line in lines)
