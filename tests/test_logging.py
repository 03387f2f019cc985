"""The tickler logger and its DEBUG log dance."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

import tickler

from .conftest import Recorder

# Every test runs with the harness's contextvars and with none at the enqueue.
pytestmark = pytest.mark.usefixtures("enqueue_context")


async def test_debug_lines_show_the_dance(caplog: pytest.LogCaptureFixture) -> None:
    """At DEBUG the pattern's lines appear: added, dequeued, processing, replenished, limit."""
    recorder = Recorder(gate=trio.Event())
    with caplog.at_level(logging.DEBUG, logger="tickler"):
        async with trio.open_nursery() as nursery:
            service = tickler.Service(recorder, capacity=2)
            await nursery.start(service.run)
            for i in range(3):
                service.enqueue_request(i)
            await trio.testing.wait_all_tasks_blocked()
            assert recorder.gate is not None
            recorder.gate.set()
            await service.stop()
    messages = [r.getMessage() for r in caplog.records if r.name == "tickler"]
    assert "request #1 added, queue length now 1" in messages
    assert "request #3 added, queue length now 3" in messages
    assert "request #1 dequeued" in messages
    assert "processing request #1 (attempt 1)" in messages
    assert "replenished: now 2/2 slots in use" in messages
    assert (
        "received loop signal, but request limit is reached (2/2 slots in use, 1 queued)"
        in messages
    )
    assert "request #3 dequeued" in messages


async def test_no_debug_lines_when_debug_is_off(caplog: pytest.LogCaptureFixture) -> None:
    """With DEBUG off nothing is formatted or emitted for the dance."""
    with caplog.at_level(logging.INFO, logger="tickler"):
        async with tickler.open_service(Recorder()) as service:
            for i in range(5):
                service.enqueue_request(i)
    assert [r for r in caplog.records if r.name == "tickler"] == []
