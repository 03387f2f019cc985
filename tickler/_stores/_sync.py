"""StoreSync: the engine's side of a store, and the rules it keeps between two batches.

Only the supervisor loop talks to the store, once per wake-up, through
:meth:`StoreSync.exchange`: one batch in one transaction on a worker thread
(the requests enqueued since the last batch, the outcomes of the attempts
that ended, lease renewals, claims for the free slots and some ahead of
them, and the final states of requests waited for that run elsewhere), then
the batch's result applied to this process's tickets. ``enqueue_request``
and the processors only append to lists here.

The engine is a part's owner, as trio's Runner owns its parts: StoreSync
holds a reference to its service (``engine``) and reaches the engine's hot
state through it; the engine holds the StoreSync (``Service._store_run``).
"""

from __future__ import annotations

import contextvars
import math
import types
import uuid
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeVar

import attrs
import trio

from .._codec import Codec, encode_key
from .._core import (
    _CANCELLED,
    _FAILED,
    _QUEUED,
    _RETRYING,
    _RUNNING,
    _SCHEDULED,
    _SUCCEEDED,
    _check_delay,
    _format_exception,
    _get_ident,
    _one_line,
    logger,
    wall_clock,
)
from .._core import _EMPTY_CONTEXT as _EMPTY
from .._engine import _Engine
from .._exceptions import RequestFailed, StoreError, Withdrawn, queue_full
from .._ticket import FINAL, Status, Ticket
from .._values import GroupLimit, Insert, Outcome, OutcomeKind, Tick
from ._seam import Batch, BatchResult, Row, Session, Store

_T = TypeVar("_T")

_SUCCEEDED_KIND = OutcomeKind.SUCCEEDED
_RETRYING_KIND = OutcomeKind.RETRYING
_FAILED_KIND = OutcomeKind.FAILED
_CANCELLED_KIND = OutcomeKind.CANCELLED
_HANDED_BACK = OutcomeKind.HANDED_BACK
_RETURNED = OutcomeKind.RETURNED
_GIVEN_BACK = (_HANDED_BACK, _RETURNED)

# The outcome an attempt's span gives for each kind of outcome the store writes.
_TRACED = {_HANDED_BACK: "withdrawn"}
_new = tuple.__new__
# An Outcome's error fields, for the kinds without an error.
_NO_ERROR: tuple[None, None, None] = (None, None, None)

# With a store, the most a process claims ahead of its free slots, in capacities.
_AHEAD = 8

SWEEP_EVERY = 30


class Ended(NamedTuple):
    """An attempt that ended (or a claimed request going back), as this process keeps it
    until the batch that writes it commits."""

    outcome: Outcome
    """What the store writes."""
    ticket: Ticket[Any, Any]
    local: Any
    """What the ticket gets once written: a success's decoded result; a failure's
    (exception, traceback, context); else None."""


@attrs.define(eq=False)
class StoreSync:
    """The state of one service's run against its store, and the rules that keep it."""

    engine: _Engine[Any, Any]
    store: Store
    codec: Codec
    owner: str = attrs.Factory(lambda: uuid.uuid4().hex)
    connection: Session | None = None
    limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    # Enqueued since the last batch, under the service's lock.
    # (Each Insert's ticket gets the id the batch's result gives it.)
    pending: list[Insert] = attrs.Factory(list)
    # Attempts that ended since the last batch.
    outcomes: list[Ended] = attrs.Factory(list)
    # This process's tickets by request id: claimed or enqueued here.
    tickets: dict[int, Ticket[Any, Any]] = attrs.Factory(dict)
    # The cancel scope of each running attempt, and why the loop cancelled it.
    scopes: dict[int, trio.CancelScope] = attrs.Factory(dict)
    reasons: dict[int, str] = attrs.Factory(dict)
    # Running attempts whose start a committed batch has written.
    marked: set[int] = attrs.Factory(set)
    # serves: pg drain: the running attempts not yet marked that the last committed batch
    # found running when it was built, and that batch's time (the store's): the next batch
    # marks those still running as started then. Most attempts of a drain end before it,
    # and their outcome writes their start: marking them too would write each row twice.
    seen: frozenset[int] = frozenset()
    seen_at: float = 0.0
    # What the batch being built found running, not marked, to be `seen` once it commits.
    unmarked: frozenset[int] = frozenset()
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
    # A pause or resume of this process's, for the next batch to write.
    pause_wanted: bool | None = None
    # The service's limits by group ("*": the rest), as Batch.limits gives them;
    # and how many ready rows the last claim left waiting for a limit.
    limits: dict[str, GroupLimit] | None = None
    limited: int = 0
    rated: bool = False  # some group has a rate limit
    # Periodic ticks for the next batch: see Batch.ticks.
    ticks: list[Tick] = attrs.Factory(list)
    # Rows this process's claims rescued, by reason ("owner_died", "lease_lapsed").
    rescued: dict[str, int] = attrs.Factory(dict)

    def return_claimed(self) -> None:
        """The queue is paused: what this process claimed ahead and has not started goes back.

        The next batch writes each back to queued, for any replica once the
        queue resumes: none stays claimed (running, in the store's eyes) by
        a process that may not start it.
        """
        engine = self.engine
        with engine._lock:
            waiting = list(engine._queue)
            engine._queue.clear()
        for ticket in waiting:
            self.outcomes.append(_ended(_RETURNED, ticket, wall_clock()))
        if waiting:
            engine._tickle()

    def attempt_started(self, request_id: int, scope: trio.CancelScope) -> None:
        """An attempt started here, under ``scope``: the loop may take it away through it."""
        self.scopes[request_id] = scope

    def attempt_ended(self, request_id: int) -> None:
        """The attempt's handler returned or raised: nothing takes it away any more."""
        del self.scopes[request_id]

    def withdrawn_reason(self, request_id: int) -> str | None:
        """Why the loop took the attempt away (once: then forgotten); None if it did not."""
        return self.reasons.pop(request_id, None) if self.reasons else None

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
    ) -> tuple[Batch, list[Insert], list[Ended]]:
        """The next batch, and what it takes from pending and outcomes (to put back if it fails).

        ``now`` is Trio's clock, which schedules the looks.
        """
        assert now is not None
        with lock:
            pending, self.pending = self.pending, []
        outcomes, self.outcomes = self.outcomes, []
        check = now >= self.next_check
        # The attempts running now whose start the store has not been told, and of those,
        # the ones the last committed batch found running already (see `seen`).
        marked = self.marked
        marked.intersection_update(self.scopes)
        started: Sequence[int] = ()
        if len(marked) < len(self.scopes):
            seen = self.seen
            unmarked = [i for i in self.scopes if i not in marked]
            started = [i for i in unmarked if i in seen] if seen else ()
            self.unmarked = frozenset(unmarked).difference(started)
        else:
            self.unmarked = frozenset()
        ticks, self.ticks = self.ticks, []
        batch = Batch(
            inserts=pending,
            pause=self.pause_wanted,
            ticks=ticks,
            limits=self.limits,
            outcomes=[ended.outcome for ended in outcomes],
            claim=claim,
            started=started,
            started_time=self.seen_at if started else None,
            renew=check,
            watched=self._watch_list() if check else (),
            prune=check,
            finished_since=self.finals_since if check else None,
        )
        tracer = self.engine._tracer
        if tracer is not None:
            batch.traces = tracer.traces_of([entry.ticket for entry in pending])
        if check:
            self.looks_begun += 1
            store = self.store
            self.next_check = now + min(store.lease / 3, store.poll_interval)
        return batch, pending, outcomes

    def put_back(self, lock: Any, pending: list[Insert], outcomes: list[Ended]) -> None:
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

    async def exchange(self) -> bool | None:
        """One batch with the store: write what was accepted and what ended, renew, claim.

        Returns whether the batch was a look (renewals, cancels, outcomes from
        elsewhere; join() waits for one), or None if it failed: then it has
        backed off, and the loop goes round again.
        """
        engine = self.engine
        # Claim for every free slot, and some more to wait in the queue,
        # so that processors go on while the next batch commits: twice
        # the attempts that ended since the last batch (the rate at
        # which slots free up; twice, so that a starved pipeline grows),
        # at most _AHEAD capacities' worth. Slots that do not free up
        # (long handlers) make it claim nothing ahead, leaving the
        # queue's other work to other processes. Nothing is claimed while
        # a cancel() settles.
        ahead = min(2 * len(self.outcomes), _AHEAD * engine._capacity)
        if self.rated:
            # A rate counts a start at its claim: what is claimed must start
            # then, not wait here behind busy slots and start in a later window.
            ahead = 0
        free = engine._capacity + ahead - engine._in_flight - len(engine._queue)
        claiming = (
            engine._may_start
            and not engine._paused
            and not engine._stopping.stop_called
            and not self.holds
        )
        claim = free if claiming and free > 0 else 0
        # Looks are scheduled on Trio's clock, never the wall clock: a step
        # of the wall clock must not stall the loop.
        batch, pending, outcomes = self.build(engine._lock, claim, engine._time())
        # After a failed batch, each insert goes in a savepoint of its own:
        # a row the store refuses cannot hold back the others.
        batch.isolate = self.failures > 0
        if not (
            batch.inserts
            or batch.outcomes
            or batch.claim
            or batch.renew
            or batch.ticks
            or batch.pause is not None
        ):
            return False
        result = await self._try_batch(batch, pending, outcomes)
        if result is None:
            self.ticks[:0] = batch.ticks  # taken again by the next batch: each at most once
            delay = min(0.05 * 2 ** min(self.failures, 10), 5.0)
            # A stop's deadline still holds: the final flush then keeps
            # trying to commit what was accepted.
            now = engine._time()
            assert now is not None
            if engine._stopping.stop_called and now >= engine._stopping.stop_deadline:
                engine._stopping.expire()
            self.seen = frozenset()  # their start is not known to precede a batch's time
            await trio.sleep_until(min(now + delay, engine._stopping.stop_deadline))
            return None
        self.marked.update(batch.started)
        self.seen, self.seen_at = self.unmarked, result.now
        if result.lost:
            self.lost_lock()
        if batch.pause is not None and self.pause_wanted is batch.pause:
            self.pause_wanted = None
        if self.pause_wanted is None and result.paused != engine._paused:
            # A pause or resume from any process, this one's once written.
            engine._set_paused(result.paused)
            if result.paused:
                self.return_claimed()
        looked = batch.finished_since is not None
        if looked:
            # Overlapping looks: a clock step back loses nothing.
            assert self.connection is not None
            self.finals_since = result.now - self.connection.finals_overlap
            self.checks = self.looks_begun  # one batch in flight at a time
        self._apply_batch(result, pending, outcomes)
        if batch.claim:
            self.limited = result.limited  # as of this claim (0 unless limits hold some back)
        return looked

    def lost_lock(self) -> None:
        """The owner's liveness lock was lost while this process lives: its rows are others'
        to rescue. Every attempt is withdrawn as for a lost lease (each ticket follows its
        row to the outcome of whoever runs it), and a new owner id, whose lock the next
        batch takes, claims from now on."""
        logger.warning(
            "service %r: the store's liveness lock of this process was lost; its running"
            " requests are withdrawn, and it goes on under a new owner id",
            self.engine.name,
        )
        self._check_leases({})
        self.owner = uuid.uuid4().hex
        self.next_check = -math.inf

    def next_due_at(self) -> float:
        """When, on Trio's clock, a row of the store falls due that this process could claim.

        The loop's next wake-up (Supervisor.supervise) asks for it only while
        requests may start; its next look (``next_check``) it takes apart.
        """
        engine = self.engine
        # next_due is on the store's clock (see BatchResult.shift), taken to
        # Trio's through this instant's wall clock, so that a step of the wall
        # clock moves both ends.
        room = engine._capacity - engine._in_flight - len(engine._queue)
        # (Rows held back by a group's limit are due, but not claimable: then
        # the next look is the regular one, or a wake-up from an enqueue.)
        if self.next_due is None or room <= 0 or self.limited:
            return math.inf
        now = engine._time()
        assert now is not None
        return self.next_due - self.shift + now - wall_clock()

    async def listen(self, listening: Any, scope: trio.CancelScope) -> None:
        """Tickle the loop whenever the store says another process enqueued on this queue."""
        engine = self.engine
        with scope:
            await listening.run(engine._tickle)

    def _apply_batch(
        self,
        result: BatchResult,
        pending: list[Insert],
        outcomes: list[Ended],
    ) -> None:
        """A batch committed: give ids, finish tickets, follow what ended elsewhere, take claims."""
        now = self.engine._time()
        assert now is not None
        self._give_ids(result, pending, now)
        self._apply_outcomes(outcomes, result.applied, now)
        if result.mine is not None:
            self._check_leases(result.mine)
        self._follow_elsewhere(result.recent)
        self._take_claimed(result, now)
        self._settle_finals(result, now)
        self.next_due = result.next_due
        self.shift = result.shift
        self.live = result.live

    def _give_ids(self, result: BatchResult, pending: list[Insert], now: float) -> None:
        """Requests committed: their tickets get ids; a live key's duplicate follows it."""
        engine = self.engine
        refused = result.refused
        if refused:
            pending = self._refused(pending, refused, now)
            inserted = [pair for i, pair in enumerate(result.inserted) if i not in refused]
        else:
            inserted = result.inserted
        for entry, (request_id, new) in zip(pending, inserted, strict=True):
            ticket = entry.ticket
            ticket.id = request_id
            if new:
                self.tickets[request_id] = ticket
            else:
                # The key was live: this ticket follows that request. It was
                # counted as enqueued when accepted; it is a deduplicated call.
                engine._intake.deduplicated += 1
                engine._last_id -= 1
                self.watched.setdefault(request_id, []).append(ticket)
        if pending:
            self.settled += len(pending)
            self.committed.set()
            self.committed = trio.Event()
            if engine._submitters:
                engine._intake.room.unpark_all()

    def _apply_outcomes(self, outcomes: list[Ended], applied: list[str | None], now: float) -> None:
        """Outcomes written: each ticket gets the state the store wrote (it decides)."""
        engine = self.engine
        # serves: pg drain: what each outcome touches, looked up once a batch.
        discard, forget, watched = self.local.discard, self.tickets.pop, self.watched
        for (written, ticket, local), state in zip(outcomes, applied, strict=True):
            kind = written.kind
            request_id = ticket.id
            discard(request_id)
            if state is None:
                if kind not in _GIVEN_BACK and not ticket.done:
                    # The lease had gone: another process runs the request.
                    forget(request_id, None)
                    watched.setdefault(request_id, []).append(ticket)
                    ticket.status = _QUEUED
                continue
            if state == "retrying":
                ticket.status = _RETRYING
                engine._outcomes.retried += 1
                continue
            if state == "queued":  # handed back
                ticket.status = _QUEUED
                continue
            forget(request_id, None)
            if state == "cancelled":  # also a retry or hand-back whose cancel was asked for
                stopped = engine._stopping.stopped_tickets
                if kind in _GIVEN_BACK and ticket in stopped:
                    stopped.remove(ticket)  # the stop handed back none of it
                kind = _CANCELLED_KIND
            if kind is _SUCCEEDED_KIND:
                engine._succeeded += 1
                engine._finish(ticket, _SUCCEEDED, (now, local))
            elif kind is _CANCELLED_KIND:
                engine._outcomes.cancelled += 1
                engine._finish(ticket, _CANCELLED, (now, None))
            else:
                exc, tb, context = local
                engine._outcomes.fail(ticket, exc, tb, now)
                engine._outcomes.call_on_error(ticket, exc, context)
            # Tickets of this process that follow the same request (a live key).
            if watched:  # serves: pg drain: mostly none, and then no lookup
                for follower in watched.pop(request_id, ()):
                    engine._finish(follower, ticket.status, ticket._state)

    def _follow_elsewhere(self, recent: list[int]) -> None:
        """Final in the store, and not by this process's hand: fetch the outcome at the next look.

        A cancel, or another process ran it.
        """
        for request_id in recent:
            elsewhere = self.tickets.get(request_id)
            if elsewhere is not None and request_id not in self.local and not elsewhere.done:
                del self.tickets[request_id]
                self.watched.setdefault(request_id, []).append(elsewhere)
                self.next_check = -math.inf

    def _take_claimed(self, result: BatchResult, now: float) -> None:
        """Claimed rows become tickets in the engine's queue (unless a stop began meanwhile)."""
        engine = self.engine
        to_trio = now - wall_clock()
        shift = result.shift
        # serves: pg drain: what each row touches, looked up once a batch; and each row read
        # by index, not unpacked into a list of its trailing columns.
        tickets, local_add, decode = self.tickets, self.local.add, self.codec.decode
        taken: list[Ticket[Any, Any]] = []
        for row in result.claimed:
            request_id, data, attempts, enqueued = row.id, row.request, row.attempts, row[4]
            if row.rescued:  # and why
                self.rescued[row.rescued] = self.rescued.get(row.rescued, 0) + 1
            local_add(request_id)
            known = tickets.get(request_id)
            if known is None:
                try:
                    request = decode(data)
                except Exception as exc:
                    known = Ticket(None, request_id, _RUNNING, attempts, now, now, _EMPTY)
                    why = (type(exc).__name__, f"cannot decode the request: {exc}", "")
                    self.record(_FAILED_KIND, known, wall_clock(), (exc, None, _EMPTY), error=why)
                    continue
                # Enqueued in the store's time, by another process: on Trio's clock,
                # no later than now (for the wait time histogram).
                enqueued_at = min(now, enqueued - shift + to_trio)
                known = Ticket(
                    request, request_id, _QUEUED, attempts - 1, enqueued_at, None, _EMPTY
                )
                tickets[request_id] = known
            else:
                known.status = _QUEUED
                known.attempts = attempts - 1
            if not engine._may_start:
                # Claimed by a batch that was under way when a stop began.
                self.record(_RETURNED, known, wall_clock())
                continue
            taken.append(known)
        if taken:
            with engine._lock:
                engine._queue.extend(taken)
                engine._peak = max(engine._peak, len(engine._queue))

    def _settle_finals(self, result: BatchResult, now: float) -> None:
        """Tickets waiting on requests that ended elsewhere (or whose rows are gone) end."""
        engine = self.engine
        for row in result.finals:
            for ticket in self.take_waiters(row.id):
                engine._finish(ticket, *self._decoded(row))
        for request_id in result.missing:
            lost = RequestFailed(
                "RowDeleted",
                "the request ended, but its row was deleted (retention) before this"
                " process read its outcome",
                "",
            )
            for ticket in self.take_waiters(request_id):
                engine._finish(ticket, _FAILED, (now, lost, None, None))

    def _refused(self, pending: list[Insert], refused: dict[int, str], now: float) -> list[Insert]:
        """Requests whose insert the store refused in an isolated batch; the others, in order.

        A refused request goes into the next batch once more (the refusal
        may have been a passing fault: a deadlock, a timeout); refused again,
        its ticket fails with StoreError, which names the store's error.
        """
        engine = self.engine
        kept: list[Insert] = []
        again: list[Insert] = []
        failed = False
        for position, entry in enumerate(pending):
            error = refused.get(position)
            if error is None:
                kept.append(entry)
                continue
            ticket = entry.ticket
            if self.refused_once.pop(ticket, None) is None:
                self.refused_once[ticket] = error
                again.append(entry)
                continue
            logger.error("service %r: the store refused a request (%s)", engine.name, error)
            self.settled += 1
            refusal = StoreError(f"the store refused the request: {error}")
            engine._outcomes.fail(ticket, refusal, None, now)
            failed = True
        if failed:
            self.committed.set()  # submit() raises the ticket's error
            self.committed = trio.Event()
        if again:
            with engine._lock:
                self.pending[:0] = again
            engine._tickle()
        return kept

    def _decoded(self, row: Row) -> tuple[Status, tuple[Any, ...]]:
        """A final row as a ticket's status and final state (FAILED if it cannot be decoded)."""
        try:
            status, final = self.decode_row(row)
        except Exception as exc:
            return _FAILED, (row.finished_at, exc, exc.__traceback__, None)
        return status, final

    def _check_leases(self, mine: dict[int, bool]) -> None:
        """Take away attempts whose lease is gone or whose request was cancelled."""
        engine = self.engine
        for request_id in list(self.scopes):
            if request_id not in mine:
                self.withdraw(request_id, "lost")
            elif mine[request_id]:
                self.withdraw(request_id, "cancelled")
        # Claimed but not started yet.
        with engine._lock:
            waiting = list(engine._queue)
            keep = [t for t in waiting if t.id in mine and not mine[t.id]]
            if len(keep) != len(waiting):
                engine._queue.clear()
                engine._queue.extend(keep)
        for ticket in waiting:
            if ticket.id not in mine:
                self.tickets.pop(ticket.id, None)
                self.local.discard(ticket.id)
                self.watched.setdefault(ticket.id, []).append(ticket)
            elif mine[ticket.id]:
                self._drop_claimed(ticket)
        # Rows the store says this process holds, though it never learned it
        # claimed them: a claim committed whose reply was lost with the
        # connection. Renewals would keep them for ever: give them back.
        for request_id in mine.keys() - self.local:
            # (Its attempt unknown, -1: the hand-back fences on the owner alone.)
            orphan: Ticket[Any, Any] = Ticket(None, request_id, _RUNNING, -1, None, None, _EMPTY)
            self.outcomes.append(_ended(_RETURNED, orphan, wall_clock()))

    def _drop_claimed(self, ticket: Ticket[Any, Any]) -> None:
        """A request claimed here, whose cancel was asked for before it started.

        Returned, it ends CANCELLED in the store (its cancel was asked for)
        with the claim's attempt undone: it never ran.
        """
        engine = self.engine
        self.outcomes.append(_ended(_RETURNED, ticket, wall_clock()))
        engine._tickle()

    async def _try_batch(
        self,
        batch: Batch,
        pending: list[Insert],
        outcomes: list[Ended],
    ) -> BatchResult | None:
        """Run a batch; if it fails, put its work back, count and log it, and return None."""
        engine = self.engine
        tracer = engine._tracer
        span = tracer.batch_started(batch) if tracer is not None else None
        try:
            result = await self.run_batch(engine.name, batch)
        except BaseException as exc:
            if tracer is not None:
                tracer.batch_ended(span, None, exc)
            # Nothing accepted is dropped: it goes into the next try, or into
            # the final flush if the run is ending.
            self.put_back(engine._lock, pending, outcomes)
            if not isinstance(exc, Exception):
                raise
            self.failures += 1
            self.errors += 1
            self.last_error = _one_line(exc)
            logger.error(
                "service %r: writing to the store failed (%s); %d failure(s) in a row",
                engine.name,
                self.last_error,
                self.failures,
            )
            return None
        if tracer is not None:
            tracer.batch_ended(span, result, None)
        self.failures = 0
        return result

    async def final_flush(self) -> None:
        """Commit what was accepted and write what ended, shielded; then close the store."""
        engine = self.engine
        with trio.CancelScope(shield=True):
            for attempt in range(20):
                batch, pending, outcomes = self.build(engine._lock, 0, engine._time())
                batch.renew, batch.watched, batch.prune = False, (), False
                if not batch.inserts and not batch.outcomes:
                    break
                result = await self._try_batch(batch, pending, outcomes)
                if result is None:
                    await trio.sleep(min(0.05 * 2**attempt, 2.0))
                    continue
                self._apply_batch(result, pending, outcomes)
            else:
                logger.error(
                    "service %r: %d accepted requests could not be committed",
                    engine.name,
                    len(self.pending),
                )
                # They exist nowhere else: their tickets fail, and say why.
                with engine._lock:
                    lost, self.pending = self.pending, []
                    self.settled += len(lost)
                now = engine._time()
                for entry in lost:
                    error = StoreError(
                        f"service {engine.name!r}: the request could not be committed to the"
                        f" store before the run ended ({self.last_error})"
                    )
                    engine._outcomes.fail(entry.ticket, error, None, now)
            self.committed.set()
            connection, self.connection = self.connection, None
            if connection is not None:
                await trio.to_thread.run_sync(connection.close, limiter=self.limiter)

    async def cancel(self, id_or_key: object) -> bool:
        """cancel() of a service with a store: see Service.cancel."""
        engine = self.engine
        # Nothing is claimed meanwhile: a request enqueued just before must not
        # start between its commit and the cancel.
        self.holds += 1
        try:
            await self.settle_accepted()
            found, request_id = await self._in_store(
                self.connection_for("cancel").cancel, id_or_key
            )
        finally:
            self.holds -= 1
            engine._tickle()
        if found:
            assert request_id is not None
            # Running here: no need to wait for the next look at the store.
            self.withdraw(request_id, "cancelled")
            # Claimed here but not started: it never starts.
            with engine._lock:
                claimed = [ticket for ticket in engine._queue if ticket.id == request_id]
                for ticket in claimed:
                    engine._queue.remove(ticket)
            for ticket in claimed:
                self._drop_claimed(ticket)
            self.next_check = -math.inf
            engine._tickle()
        return found

    async def lookup(self, id_or_key: object) -> Ticket[Any, Any] | None:
        """lookup(): see Service.lookup."""
        engine = self.engine
        await self.settle_accepted()
        row = await self._in_store(self.connection_for("lookup").lookup, id_or_key)
        if row is None:
            return None
        status = Status(row.state)
        try:
            request = self.codec.decode(row.request)
        except Exception:
            request = None  # another codec's bytes: the ticket's state still holds
        ticket: Ticket[Any, Any] = Ticket(
            request, row.id, status, row.attempts, row.enqueued_at, row.started_at, _EMPTY
        )
        if status in FINAL:
            # (A result this codec cannot decode fails the ticket with the error.)
            ticket.status, ticket._state = self._decoded(row)
        elif not engine._stopping.finished.is_set():
            # The ticket follows the row to its final state, wherever it
            # runs: this process's looks at the store finish it (the next
            # look, within poll_interval, or at once if it runs here).
            self.watched.setdefault(row.id, []).append(ticket)
        return ticket

    async def settle_accepted(self) -> None:
        """Wait until every request this service accepted so far is in the store.

        What the caller enqueued before a cancel or a lookup must be seen by
        it, as program order says, even though enqueues commit in batches.
        """
        engine = self.engine
        with engine._lock:
            wanted = self.accepted
        if self.settled >= wanted:
            return
        engine._tickle()
        while self.settled < wanted and not engine._stopping.finished.is_set():
            await self.committed.wait()

    async def statistics(self) -> dict[str, int]:
        """store_statistics(): see Service.store_statistics."""
        await self.settle_accepted()
        return await self._in_store(self.connection_for("store_statistics").statistics)

    async def _in_store(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Call a blocking method of the session on the store's worker thread."""
        return await trio.to_thread.run_sync(fn, self.engine.name, *args, limiter=self.limiter)

    # -- what comes in

    def accept(
        self,
        request: Any,
        key: Hashable | None,
        delay: float | None,
        ticket: Ticket[Any, Any] | None,
        *,
        waits: bool = False,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> Ticket[Any, Any]:
        """A request accepted (enqueue_request, submit): encoded now, committed by the next batch.

        The request waits in the pending list, bounded by
        ``max_queue_length``; its ticket's id is 0 until the batch commits it.
        """
        engine = self.engine
        key_text = encode_key(key) if key is not None else None
        if delay is not None:
            delay = _check_delay(delay)
        data, request = self.encode(request)
        status = _QUEUED if delay is None else _SCHEDULED
        if ticket is None:
            context = engine._capture_context()
            ticket = Ticket(request, 0, status, 0, None, None, context)
        else:
            ticket.request = request
            ticket.status = status
        enqueued_at = wall_clock()
        run_at = enqueued_at + (delay or 0.0)
        unique_until = enqueued_at + unique_for if unique_for is not None else None
        with engine._lock:
            engine._intake.check_open()
            bound = engine.max_queue_length
            if bound is not None and len(self.pending) >= bound:
                if not waits:
                    engine._intake.rejected += 1
                engine._last_context = None
                raise queue_full(engine.name, bound, len(self.pending), 1)
            ticket.enqueued_at = engine._time()
            ticket.id = 0
            engine._last_id += 1
            self.pending.append(
                Insert(key_text, status.value, data, run_at, priority, unique_until, group, ticket)
            )
            self.accepted += 1
            if engine._thread == _get_ident():
                engine._tickle()
            else:
                engine._wake_from_thread()
        if engine._tracer is not None:
            engine._tracer.enqueued((ticket,))
        return ticket

    def encode(self, request: Any) -> tuple[bytes, Any]:
        """The request as the store keeps it, and as every process reads it back."""
        try:
            data = self.codec.encode(request)
        except TypeError:
            raise
        except Exception as exc:
            raise TypeError(f"the codec cannot encode {type(request).__name__}: {exc}") from exc
        if not isinstance(data, bytes):
            raise TypeError(f"codec.encode must return bytes, not {type(data).__name__}")
        # The handler gets what every process would read from the store: the
        # codec's round trip, here too (a tuple comes back a list, say).
        try:
            decoded = self.codec.decode(data)
        except Exception as exc:
            raise TypeError(
                f"the codec cannot decode what it encoded of a {type(request).__name__}: {exc}"
            ) from exc
        return data, decoded

    def accept_many(
        self,
        requests: list[Any],
        keys: list[Hashable | None] | None,
        delay: float | None,
        priority: int,
        unique_for: float | None,
        group: str | None = None,
    ) -> list[Ticket[Any, Any]]:
        """enqueue_many with a store: all accepted into pending, or none (QueueFull).

        Keys are settled by the store's batch: a key taken there, or
        repeated here, gives a ticket that follows its holder.
        """
        engine = self.engine
        key_texts = [encode_key(k) if k is not None else None for k in keys or ()]
        encoded = [self.encode(request) for request in requests]
        status = _QUEUED if delay is None else _SCHEDULED
        context = engine._capture_context()
        enqueued_at = wall_clock()
        run_at = enqueued_at + (delay or 0.0)
        unique_until = enqueued_at + unique_for if unique_for is not None else None
        tickets: list[Ticket[Any, Any]] = []
        with engine._lock:
            engine._intake.check_open()
            bound = engine.max_queue_length
            if bound is not None and len(self.pending) + len(requests) > bound:
                engine._intake.rejected += len(requests)
                engine._last_context = None
                raise queue_full(engine.name, bound, len(self.pending), len(requests))
            now = engine._time()
            for index, (data, decoded) in enumerate(encoded):
                ticket: Ticket[Any, Any] = Ticket(decoded, 0, status, 0, now, None, context)
                key_text = key_texts[index] if key_texts else None
                self.pending.append(
                    Insert(
                        key_text, status.value, data, run_at, priority, unique_until, group, ticket
                    )
                )
                tickets.append(ticket)
            engine._last_id += len(tickets)
            self.accepted += len(tickets)
            if engine._thread == _get_ident():
                engine._tickle()
            else:
                engine._wake_from_thread()
        if engine._tracer is not None:
            engine._tracer.enqueued(tickets)
        return tickets

    # -- what ended: recorded here, written by the next batch, which then finishes tickets

    def record(
        self,
        kind: OutcomeKind,
        ticket: Ticket[Any, Any],
        at: float,
        local: Any = None,
        *,
        result: bytes | None = None,
        error: tuple[str, str, str] | tuple[None, None, None] = _NO_ERROR,
    ) -> None:
        """An attempt ended (or a claimed request goes back) at ``at`` (a retry's or a
        hand-back's: when it is due again): the next batch writes it (see Outcome)."""
        engine = self.engine
        self.outcomes.append(_ended(kind, ticket, at, local, result, error))
        if kind in _GIVEN_BACK:
            engine._stopping.stopped_tickets.append(ticket)
        if engine._tracer is not None:
            engine._tracer.ended(
                ticket,
                _TRACED.get(kind, kind.value),
                delay=at - wall_clock() if kind is _RETRYING_KIND else None,
                reason="stopped" if kind is _HANDED_BACK else None,
                error=local[0] if kind is _FAILED_KIND and local is not None else None,
            )
        engine._tickle()

    def record_success(
        self, ticket: Ticket[Any, Any], result: Any, context: contextvars.Context
    ) -> bool:
        """Record the attempt's success; True if the loop had begun to take it away."""
        # Taken away too late: it ended by itself.
        late = bool(self.reasons) and self.reasons.pop(ticket.id, None) is not None
        if result is None:
            # What most handlers return: kept as NULL, read back as None.
            self.record(_SUCCEEDED_KIND, ticket, wall_clock())
            return late
        try:
            data = self.codec.encode(result)
            if not isinstance(data, bytes):
                kind = type(data).__name__
                raise TypeError(f"codec.encode must return bytes, not {kind}")  # noqa: TRY301
            # The handler's result as every other process would read it: the
            # codec's round trip (a tuple comes back a list, say).
            decoded = self.codec.decode(data)
        except Exception as exc:
            # A programming error, not a passing fault: the request fails at
            # once, never retried (a retry would repeat the handler's effects).
            error = TypeError(
                f"the codec cannot encode the result, a {type(result).__name__}: {exc}"
            )
            text = (_storable("TypeError"), _storable(str(error)), _storable(str(error)))
            self.record(_FAILED_KIND, ticket, wall_clock(), (error, None, context), error=text)
            return late
        self.record(_SUCCEEDED_KIND, ticket, wall_clock(), decoded, result=data)
        return late

    def record_failure(
        self,
        ticket: Ticket[Any, Any],
        exc: Exception,
        tb: types.TracebackType | None,
        context: contextvars.Context,
    ) -> None:
        """Record the attempt's failure: retried in the row, failed, or taken away."""
        engine = self.engine
        if self.reasons and not isinstance(exc, Withdrawn):
            # Taken away too late: it ended by itself.
            self.reasons.pop(ticket.id, None)
        if isinstance(exc, Withdrawn):
            if exc.reason == "lost":
                if engine._tracer is not None:
                    engine._tracer.ended(ticket, "withdrawn", reason="lost")
                # Another process holds the request now: wait for its outcome.
                self.tickets.pop(ticket.id, None)
                self.local.discard(ticket.id)
                self.watched.setdefault(ticket.id, []).append(ticket)
                ticket.status = Status.QUEUED
                return
            kind = _CANCELLED_KIND if exc.reason == "cancelled" else _HANDED_BACK
            self.record(kind, ticket, wall_clock())
            return
        text = (
            _storable(type(exc).__name__),
            _bounded(_storable(str(exc)), MAX_ERROR_MESSAGE_CHARS),
            _bounded(_storable(_format_exception(exc)), MAX_TRACEBACK_CHARS),
        )
        retry = engine._outcomes.retry
        if retry is not None and retry.should_retry(ticket.attempts, exc):
            if not engine._may_start:
                self.record(_HANDED_BACK, ticket, wall_clock())
                return
            delay = retry.delay(ticket.attempts)
            self.record(_RETRYING_KIND, ticket, wall_clock() + delay, error=text)
            engine._outcomes.log_retry(ticket, exc, delay, context)
            return
        self.record(_FAILED_KIND, ticket, wall_clock(), (exc, tb, context), error=text)


# What a row keeps of an attempt's error at most, in characters: its message, and its
# traceback (what a deep recursion or an exception group's can grow to). The rest is cut
# from the middle: the head says where it began, the tail where it ended, and what.
MAX_ERROR_MESSAGE_CHARS = 4_000
MAX_TRACEBACK_CHARS = 20_000


def _bounded(text: str, limit: int) -> str:
    """``text``, or its head and tail with a line saying how much was cut between them."""
    if len(text) <= limit:
        return text
    head = limit // 4
    note = "\n[... {} characters cut ...]\n"
    tail = limit - head - len(note.format(len(text)))
    return text[:head] + note.format(len(text) - head - tail) + text[-tail:]


def _ended(
    kind: OutcomeKind,
    ticket: Ticket[Any, Any],
    at: float,
    local: Any = None,
    result: bytes | None = None,
    error: tuple[str, str, str] | tuple[None, None, None] = _NO_ERROR,
) -> Ended:
    """An outcome of the ticket's attempt, and what the ticket gets once it is written.

    The store writes it only at the row's attempt it is for: a claimed request handed back
    before it started counts the claim's attempt, which its ticket does not yet; None if
    unknown (an attempt of -1).
    """
    attempts = ticket.attempts
    attempt = None if attempts < 0 else attempts + 1 if kind is _RETURNED else attempts
    # serves: pg drain: every field given, so built as tuples are (skipping the
    # NamedTuples' __new__ and its defaults: half the time).
    outcome = _new(Outcome, (kind, ticket.id, at, result, *error, attempt))
    return _new(Ended, (outcome, ticket, local))


def _storable(text: str) -> str:
    """Text every store can keep: lone surrogates (say, from surrogateescape) and NULs escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
