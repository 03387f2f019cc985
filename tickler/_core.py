"""What the engine and every part of it share: the statuses, argument checks, log helpers.

Nothing here holds state; every module of the engine may import it, and it
imports none of them.
"""

from __future__ import annotations

import contextvars
import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ._ticket import RequestT, ResultT, Status, Ticket

logger = logging.getLogger("tickler")

Handler = Callable[[RequestT], Awaitable[ResultT]]
ErrorHook = Callable[[Ticket[RequestT, ResultT], Exception], object]

_QUEUED = Status.QUEUED
_SCHEDULED = Status.SCHEDULED
_RUNNING = Status.RUNNING
_RETRYING = Status.RETRYING
_SUCCEEDED = Status.SUCCEEDED
_FAILED = Status.FAILED
_CANCELLED = Status.CANCELLED

_Context = contextvars.Context
_get_ident = threading.get_ident
_UNBOUNDED = sys.maxsize
_EMPTY_CONTEXT = contextvars.Context()
_MISSING = object()


def _check_timeout(name: str, value: object, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number or None")
    if allow_zero:
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0")
    elif not value > 0:
        raise ValueError(f"{name} must be > 0")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be at most {sys.float_info.max:g} seconds") from None


# The longest delay a request (or a retry) may wait: 100 years of 365 days. A due
# time that far off is still a date every store, the admin and the dashboard can
# write and read (a datetime ends at the year 9999).
MAX_DELAY = 100 * 365 * 86400.0


def _check_delay(value: object, name: str = "delay") -> float:
    """A wait before a request runs, checked: seconds from 0 to MAX_DELAY.

    The one rule for every enqueue (enqueue_request, submit, enqueue_many, the
    stores' enqueue_in and enqueue_many_in) and for Retry's ``maximum``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds or None, not {type(value).__name__}")
    if not 0 <= value <= MAX_DELAY:
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0")
        if value == math.inf:
            raise ValueError(f"{name} must be finite")
        raise ValueError(f"{name} must be at most {MAX_DELAY} seconds (100 years)")
    return float(value)


def _check_key(key: object) -> None:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable, not {type(key).__name__}") from None


# The largest id of a request, as every store numbers them (PostgreSQL's bigint, SQLite's
# integer): a larger int names no request.
MAX_ID = 2**63 - 1


# What a priority may be: PostgreSQL's integer column holds it.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def check_priority(value: object) -> int:
    """A request's priority, checked: an int in the 32-bit signed range (what a store keeps).

    The one rule for every enqueue that takes it (enqueue_request, submit,
    enqueue_many, Periodic, the stores' enqueue_in and enqueue_many_in).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"priority must be an int, not {type(value).__name__}")
    low, high = PRIORITY_RANGE
    if not low <= value <= high:
        raise ValueError(f"priority must be between {low} and {high}")
    return value


def check_unique_for(value: object, key: object) -> float | None:
    """How long a key stays taken, checked: None, or seconds > 0 and at most MAX_DELAY,
    or math.inf (for as long as the request is kept).

    The one rule for every enqueue that takes it (enqueue_request, submit,
    enqueue_many, the stores' enqueue_in and enqueue_many_in); ``key`` is the key
    (or the callable giving each request's), which a hold needs.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = type(value).__name__
        raise TypeError(f"unique_for must be a number of seconds or None, not {kind}")
    if not (0 < value <= MAX_DELAY or value == math.inf):  # NaN too
        raise ValueError(
            f"unique_for must be > 0 and at most {MAX_DELAY} seconds (100 years),"
            " or math.inf (for good)"
        )
    if key is None:
        raise ValueError("unique_for needs a key: it says how long the key stays taken")
    return float(value)


def _format_exception(exc: BaseException) -> str:
    # Log records get the traceback as text: a record that kept the exception
    # would keep its frames, and through them the request, alive.
    return "".join(traceback.format_exception(exc)).rstrip()


def _one_line(exc: BaseException) -> str:
    """``ExcType: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _run_in(context: contextvars.Context, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn`` in a copy of a request's context: hooks and log lines for a request.

    A copy, because the request's context is the one running right now, and a
    Context cannot be entered twice; and the hook's own writes stay its own.
    """
    return context.copy().run(fn, *args)


def _is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is trio.Cancelled, or a group (a handler's nursery) holding only that."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def wall_clock() -> float:
    """This process's wall clock, as rows are written with it: seconds since the epoch."""
    return time.time()
