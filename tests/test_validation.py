"""Bad input gets a clear TypeError or ValueError at once."""

from __future__ import annotations

from typing import Any

import pytest

import tickler


async def handler(request: object) -> object:
    return request


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"capacity": 0}, ValueError, r"^capacity must be >= 1$"),
        ({"capacity": -3}, ValueError, r"^capacity must be >= 1$"),
        ({"capacity": 2.0}, TypeError, r"^capacity must be an int$"),
        ({"capacity": True}, TypeError, r"^capacity must be an int$"),
        ({"capacity": "3"}, TypeError, r"^capacity must be an int$"),
        ({"max_queue_length": 0}, ValueError, r"^max_queue_length must be >= 1$"),
        ({"max_queue_length": 1.5}, TypeError, r"^max_queue_length must be an int or None$"),
        ({"timeout": 0}, ValueError, r"^timeout must be > 0$"),
        ({"timeout": -1.0}, ValueError, r"^timeout must be > 0$"),
        ({"timeout": float("nan")}, ValueError, r"^timeout must be > 0$"),
        ({"timeout": "1"}, TypeError, r"^timeout must be a number or None$"),
        ({"retry": 3}, TypeError, r"^retry must be a tickler.Retry or None$"),
        ({"on_error": "log"}, TypeError, r"^on_error must be callable or None$"),
        ({"name": 7}, TypeError, r"^name must be a str$"),
    ],
)
def test_bad_option_is_refused(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each bad option raises at construction with a message naming the rule."""
    with pytest.raises(error, match=message):
        tickler.Service(handler, **kwargs)


def test_handler_must_be_callable() -> None:
    """A non-callable handler is a TypeError."""
    with pytest.raises(TypeError, match=r"^handler must be callable$"):
        tickler.Service(42)  # type: ignore[arg-type]


def test_constructor_needs_no_trio_loop() -> None:
    """A Service can be built, and fed, outside any Trio run."""
    service = tickler.Service(handler, capacity=2)
    ticket = service.enqueue_request("early")
    assert ticket.status is tickler.Status.QUEUED
    assert ticket.enqueued_at is None
    assert service.statistics().queued == 1


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, r"^capacity must be >= 1$"),
        (1.0, TypeError, r"^capacity must be an int$"),
        (None, TypeError, r"^capacity must be an int$"),
    ],
)
def test_capacity_setter_refuses_and_keeps_old_value(
    value: object, error: type[Exception], message: str
) -> None:
    """A refused capacity leaves the previous one in place."""
    service = tickler.Service(handler, capacity=4)
    with pytest.raises(error, match=message):
        service.capacity = value  # type: ignore[assignment]
    assert service.capacity == 4
    assert service.statistics().capacity == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"timeout": -1}, ValueError, r"^timeout must be >= 0$"),
        ({"timeout": "soon"}, TypeError, r"^timeout must be a number or None$"),
        ({"drain": "yes"}, TypeError, r"^drain must be a bool$"),
    ],
)
async def test_bad_stop_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    """stop() checks its arguments before it begins anything."""
    service = tickler.Service(handler)
    with pytest.raises(error, match=message):
        await service.stop(**kwargs)
    assert not service.closed


async def test_bad_shutdown_timeout_is_refused() -> None:
    """open_service checks shutdown_timeout before starting anything."""
    with pytest.raises(ValueError, match=r"^shutdown_timeout must be >= 0$"):
        async with tickler.open_service(handler, shutdown_timeout=-1):
            pass  # pragma: no cover
