"""The loop's side of a store: what a service with a store keeps between two batches.

Only the supervisor loop talks to the store, once per wake-up, through one
batch in one transaction on a worker thread: the requests enqueued since the
last batch, the outcomes of the attempts that ended, lease renewals, claims
for the free slots and some ahead of them (see _Loop._supervise_store), and
the final states of requests waited for that run elsewhere. enqueue_request
and the processors only append to lists here.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import attrs
import trio

from ._codec import Codec
from ._exceptions import TicklerError
from ._stores._seam import Batch, BatchResult, Row, Session, Store
from ._ticket import Status, Ticket

SWEEP_EVERY = 30

# (key text, state, encoded request, run_at, ticket): a Batch's insert as it is.
Pending = tuple[str | None, str, bytes, float, Ticket[Any, Any]]
# (kind, ticket, values for its row, what the ticket gets once written)
Outcome = tuple[str, Ticket[Any, Any], tuple[Any, ...], Any]


class RequestFailed(TicklerError):
    """A request's failure as the store keeps it: as text, from whichever process ran it.

    Attributes:
        error_type: the name of the exception's type.
        error_message: its message.
        error_traceback: its traceback, as text.
    """

    def __init__(self, error_type: str, error_message: str, error_traceback: str) -> None:
        super().__init__(f"{error_type}: {error_message}")
        self.error_type = error_type
        self.error_message = error_message
        self.error_traceback = error_traceback


class Withdrawn(Exception):
    """Raised in place of an attempt the loop took away: cancelled, handed back or lost."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.define(eq=False)
class StoreRun:
    """The state of one service's run against its store."""

    store: Store
    codec: Codec
    owner: str = attrs.Factory(lambda: uuid.uuid4().hex)
    connection: Session | None = None
    limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    # Enqueued since the last batch, under the service's lock.
    pending: list[Pending] = attrs.Factory(list)
    # Attempts that ended since the last batch: (kind, ticket, values for the
    # row, what the ticket gets once the row is written).
    outcomes: list[Outcome] = attrs.Factory(list)
    # This process's tickets by request id: claimed or enqueued here.
    tickets: dict[int, Ticket[Any, Any]] = attrs.Factory(dict)
    # The cancel scope of each running attempt, and why the loop cancelled it.
    scopes: dict[int, trio.CancelScope] = attrs.Factory(dict)
    reasons: dict[int, str] = attrs.Factory(dict)
    # Running attempts whose start a committed batch has written.
    marked: set[int] = attrs.Factory(set)
    # Requests claimed by this process whose outcome is not written yet.
    local: set[int] = attrs.Factory(set)
    # The time from which the next look asks which requests became final.
    finals_since: float = 0.0
    # Looks at the store begun so far (renewals, cancels, outcomes from
    # elsewhere), and the number of the last one that committed: join()
    # trusts only a look begun after it was called.
    looks_begun: int = 0
    checks: int = 0
    # Tickets waiting for requests that run elsewhere (a live key, a lost lease).
    watched: dict[int, list[Ticket[Any, Any]]] = attrs.Factory(dict)
    # Set after each commit; submit() waits for the batch holding its request.
    committed: trio.Event = attrs.Factory(trio.Event)
    # Requests accepted into pending so far (under the service's lock), and
    # how many of them have been settled: committed, refused by the store, or
    # failed by the final flush. cancel() and lookup() wait until every
    # request accepted before them is settled, so that they see it.
    accepted: int = 0
    settled: int = 0
    # cancel() calls under way: batches claim nothing meanwhile.
    holds: int = 0
    # Requests the store refused once in an isolated batch, and its error.
    refused_once: dict[Ticket[Any, Any], str] = attrs.Factory(dict)
    # When the next look at the store is due, on Trio's clock.
    next_check: float = -math.inf
    next_due: float | None = None
    shift: float = 0.0  # the store's clock minus this process's, as of the last batch
    live: int = 0
    failures: int = 0  # in a row, for the backoff
    errors: int = 0  # in all, for statistics()
    last_error: str = ""  # the last failed batch's error, in one line
    # A batch is in flight: what it took from pending is not in the store yet.
    committing: bool = False

    def withdraw(self, request_id: int, reason: str) -> bool:
        """Cancel a running attempt; True if it was running here."""
        scope = self.scopes.get(request_id)
        if scope is None:
            return False
        if self.reasons.get(request_id) == "cancelled":
            return True  # a cancel already took it: a stop's hand-back does not undo that
        self.reasons[request_id] = reason
        scope.cancel()
        return True

    def connection_for(self, what: str) -> Session:
        if self.connection is None:
            raise RuntimeError(f"{what}() needs the service to be running")
        return self.connection

    def has_work(self) -> bool:
        return bool(self.pending or self.outcomes)

    def build(
        self, lock: Any, claim: int, now: float | None
    ) -> tuple[Batch, list[Pending], list[Outcome]]:
        """The next batch, and what it takes from pending and outcomes (to put back if it fails).

        ``now`` is Trio's clock, which schedules the looks.
        """
        assert now is not None
        with lock:
            pending, self.pending = self.pending, []
        outcomes, self.outcomes = self.outcomes, []
        check = now >= self.next_check
        # The attempts running now whose start the store has not been told.
        marked = self.marked
        marked.intersection_update(self.scopes)
        started = (
            [i for i in self.scopes if i not in marked] if len(marked) < len(self.scopes) else ()
        )
        batch = Batch(
            inserts=pending,
            outcomes=[(kind, ticket.id, values) for kind, ticket, values, _ in outcomes],
            claim=claim,
            started=started,
            renew=check,
            watched=self._watch_list() if check else (),
            prune=check,
            finished_since=self.finals_since if check else None,
        )
        if check:
            self.looks_begun += 1
            store = self.store
            self.next_check = now + min(store.lease / 3, store.poll_interval)
        return batch, pending, outcomes

    def put_back(self, lock: Any, pending: list[Pending], outcomes: list[Outcome]) -> None:
        """A batch failed: its requests and outcomes go into the next one."""
        with lock:
            self.pending[:0] = pending
        self.outcomes[:0] = outcomes

    def _watch_list(self) -> list[int]:
        """The ids whose final state the next look asks for.

        Those followed from elsewhere; and, every SWEEP_EVERY looks, every
        ticket of this process that does not run here, should a look at what
        became final have missed it (a step back of the wall clock, say).
        """
        ids = list(self.watched)
        if self.checks % SWEEP_EVERY == SWEEP_EVERY - 1:
            ids.extend(i for i in self.tickets if i not in self.local and i not in self.watched)
        return ids

    async def run_batch(self, queue: str, batch: Batch) -> BatchResult:
        connection = self.connection
        assert connection is not None
        store = self.store
        self.committing = True
        try:
            return await trio.to_thread.run_sync(
                connection.run,
                queue,
                self.owner,
                store.lease,
                store.retention,
                batch,
                limiter=self.limiter,
            )
        finally:
            self.committing = False

    def decode_row(self, row: Row) -> tuple[Status, tuple[Any, ...]]:
        """A final row as (status, final ticket state)."""
        finished = row.finished_at
        if row.state == "succeeded":
            result = self.codec.decode(row.result) if row.result is not None else None
            return Status.SUCCEEDED, (finished, result)
        if row.state == "failed":
            error = RequestFailed(
                row.error_type or "Exception", row.error_message or "", row.error_traceback or ""
            )
            return Status.FAILED, (finished, error, None, None)
        return Status.CANCELLED, (finished, None)

    def take_waiters(self, request_id: int) -> list[Ticket[Any, Any]]:
        """The unfinished tickets of this process waiting on a request that ended elsewhere.

        Those following it (a live key, a lost lease), and its own ticket if
        it does not run here (found by the periodic sweep); all stop waiting.
        """
        waiters = self.watched.pop(request_id, [])
        own = self.tickets.get(request_id)
        if own is not None and request_id not in self.local:
            del self.tickets[request_id]
            waiters.append(own)
        return [ticket for ticket in waiters if not ticket.done]


def wall_clock() -> float:
    return time.time()
