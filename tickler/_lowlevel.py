"""Every use of Trio beyond its public API, in one place, each with a public fallback.

tickler's hot path reads three things Trio does not promise:

- whether the processor's task is cancelled, as ``Task._cancel_status``;
- the default clock's offset from ``time.perf_counter()``;
- and it assigns ``Task.context``, which Trio documents for reading.

Each is checked here, once, at import (or for the clock, when a run starts).
Where the check fails, tickler takes a public path that is slower but just
as correct; ``tests/test_lowlevel.py`` runs the engine on both paths.
"""

from __future__ import annotations

import contextvars
import math
import time
from typing import Any

import trio


class _PublicCancelStatus:
    """``effectively_cancelled`` of the current task, asked the public way.

    ``trio.current_effective_deadline()`` is ``-inf`` exactly when the
    calling task's innermost cancel scope is cancelled.
    """

    __slots__ = ()

    @property
    def effectively_cancelled(self) -> bool:
        return trio.current_effective_deadline() == -math.inf


_PUBLIC_CANCEL_STATUS = _PublicCancelStatus()

# Trio keeps each task's cancel status in a private attribute whose
# ``effectively_cancelled`` it updates as scopes are cancelled: one attribute
# load (the burst rows), where the public question costs a function call and
# a walk up the scopes (about a tenth of a request).
PRIVATE_CANCEL_STATUS = hasattr(trio.lowlevel.Task, "_cancel_status") and hasattr(
    getattr(trio.lowlevel.Task, "__attrs_attrs__", None), "_cancel_status"
)


def cancel_status(task: trio.lowlevel.Task) -> Any:
    """An object whose ``effectively_cancelled`` says whether ``task`` is cancelled now.

    Read it from ``task`` itself, in the cancel scope that was current when
    this was called: the private object belongs to that scope.
    """
    if PRIVATE_CANCEL_STATUS:
        status = task._cancel_status
        if type(getattr(status, "effectively_cancelled", None)) is bool:
            return status
    return _PUBLIC_CANCEL_STATUS


def _context_is_assignable() -> bool:
    """Whether ``Task.context`` is a plain attrs field that Trio reads at each step."""
    fields = getattr(trio.lowlevel.Task, "__attrs_attrs__", None)
    field = getattr(fields, "context", None)
    return field is not None and field.on_setattr in (None, [])


# A processor runs attempt after attempt in one task; an attempt whose
# handler set contextvars of its own leaves them in the task's context.
# Assigning a fresh context clears them (the burst rows keep one task for
# many requests); without that, the processor ends and the loop starts a new
# task, which starts with a fresh context.
CONTEXT_ASSIGNABLE = _context_is_assignable()


def reset_context(task: trio.lowlevel.Task, empty: contextvars.Context) -> bool:
    """Give ``task`` a fresh copy of ``empty`` as its context; False if Trio does not allow it."""
    if not CONTEXT_ASSIGNABLE:
        return False
    task.context = empty.copy()
    return True


def clock_offset(clock: trio.abc.Clock) -> float:
    """For Trio's default clock, its offset from ``time.perf_counter()``; else 0.

    Trio's default clock reads ``offset + perf_counter()`` through a Python
    method. The hot paths read the same sum themselves, which costs a tenth
    of the call. The formula is checked against the clock before it is used;
    0 means: call ``clock.current_time()``.
    """
    kind = type(clock)
    offset = getattr(clock, "offset", None)
    if (kind.__module__, kind.__qualname__) != ("trio._core._run", "SystemClock") or (
        type(offset) is not float or not offset
    ):
        return 0.0
    before = clock.current_time()
    read = offset + time.perf_counter()
    after = clock.current_time()
    return offset if before <= read <= after else 0.0
