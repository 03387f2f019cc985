"""The request states, once: each state, the sets every part of tickler names, and their SQL.

A ticket's :class:`Status`, a store's ``state`` column, the admin's filters, the
dashboard's columns and the command line all read this table. SQL text that must
stay a literal (a partial index's predicate, a schema's DDL) is checked against
it by tests/test_structure.py. Imports nothing of tickler.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Status(enum.Enum):
    """Where a request is in its life. The last three are final."""

    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Every state, in the order of a request's life: what a store's ``state`` column holds.
STATES = tuple(status.value for status in Status)
# The states that hold their key, and that a cancel acts on.
LIVE = ("queued", "scheduled", "running", "retrying")
# The states waiting for an attempt: a store claims them once their run_at has come.
READY = ("queued", "scheduled", "retrying")
# The states a request ends in.
FINAL = ("succeeded", "failed", "cancelled")
# The final states an attempt ended in: what the histograms and the hour's counts count.
ENDED = ("succeeded", "failed")
# The states a retry (the admin's, the dashboard's) queues again.
RETRYABLE = ("failed", "cancelled")
# What a store's statistics count a running row under while its attempt has not started
# (claimed ahead of a free slot, started_at still NULL). Not a state: no row holds it.
CLAIMED = "claimed"
# What statistics() counts: the states, with the claimed rows beside the running ones.
COUNTED = ("queued", "scheduled", CLAIMED, "running", "retrying", *FINAL)
# The live ones among them: what a group's line of ``inspect`` counts.
COUNTED_LIVE = tuple(state for state in COUNTED if state not in FINAL)

# The same sets as statuses, for the tickets of a service.
FINAL_STATUSES = frozenset(Status(state) for state in FINAL)


def sql_in(states: Iterable[str], column: str = "state") -> str:
    """``state IN ('a', 'b')`` for a set of states (``state = 'a'`` for one): the SQL of a
    named set, written the same way wherever it is written."""
    names = tuple(states)
    for name in names:
        if name not in STATES:
            raise ValueError(f"{name!r} is not a state of tickler")
    if len(names) == 1:
        return f"{column} = '{names[0]}'"
    listed = ", ".join(f"'{name}'" for name in names)
    return f"{column} IN ({listed})"


def sql_any(states: Iterable[str], column: str = "state") -> str:
    """``(state = 'a' OR state = 'b')``: a set as ORs, the form SQLite's partial indexes
    are written in (see tickler/_stores/sqlite.py)."""
    names = tuple(states)
    for name in names:
        if name not in STATES:
            raise ValueError(f"{name!r} is not a state of tickler")
    return "(" + " OR ".join(f"{column} = '{name}'" for name in names) + ")"
