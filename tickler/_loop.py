"""The supervisor loop: dispatch, sleep until tickled or due; and stopping and joining."""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

import trio

from . import _lowlevel
from ._core import (
    _CANCELLED,
    _EMPTY_CONTEXT,
    _FAILED,
    _QUEUED,
    _RETRYING,
    _RUNNING,
    _SCHEDULED,
    _SUCCEEDED,
    _check_timeout,
    _get_ident,
    _one_line,
    logger,
)
from ._core import (
    _EMPTY_CONTEXT as _EMPTY,
)
from ._exceptions import ServiceClosed, StoreError
from ._processors import _ATTEMPTS, _Processors, _Slot
from ._queue import _check_key
from ._store_loop import Outcome, Pending, RequestFailed, StoreRun, wall_clock
from ._stores._seam import Batch, BatchResult, Row
from ._ticket import FINAL, RequestT, ResultT, Status, Ticket

_T = TypeVar("_T")

# With a store, the most a process claims ahead of its free slots, in capacities.
_AHEAD = 8


class _Loop(_Processors[RequestT, ResultT]):
    """One supervisor loop, woken through the one-slot signal, starts every processor."""

    __slots__ = ()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the service until it is stopped; use ``await nursery.start(service.run)``.

        Raises:
            ServiceClosed: the service was stopped before it ran.
            RuntimeError: ``run`` was already called.
        """
        if self._stop_called and self._token is None:
            raise ServiceClosed(f"service {self.name!r} was stopped before it ran")
        if self._token is not None:
            raise RuntimeError(f"service {self.name!r} has already run")
        if self._bound is not None and self._bound is not trio.lowlevel.current_trio_token():
            raise RuntimeError(
                f"service {self.name!r} was waited on from another Trio run before it ran;"
                " run it in that one"
            )
        stored = self._store_run
        if stored is not None:
            # Open and check the store before anything starts: a bad file
            # raises StoreError from here, with nothing written.
            stored.connection = await trio.to_thread.run_sync(stored.store.connect)
            stored.finals_since = wall_clock()
        self._signal_tx, self._signal_rx = trio.open_memory_channel[None](1)
        clock = trio.lowlevel.current_clock()
        now = clock.current_time()
        with self._lock:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = _get_ident()
            # The offset first: a thread that sees the timer sees its offset.
            self._timer, self._offset = None, _lowlevel.clock_offset(clock)
            self._timer = time.perf_counter if self._offset else clock.current_time
            for ticket in self._queue:
                ticket.enqueued_at = now
            for _, ticket in self._incoming:
                ticket.enqueued_at = now
            if stored is not None:
                for pending in stored.pending:
                    pending[4].enqueued_at = now
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                listener_scope = trio.CancelScope()
                listening = stored.store.listener(self.name) if stored is not None else None
                if listening is not None:
                    nursery.start_soon(self._listen, listening, listener_scope)
                await self._supervise(stored)
                listener_scope.cancel()
        finally:
            if stored is not None:
                # Whatever ended the run, commit what was accepted and hand
                # back what was claimed: a stop never loses a request.
                self._close()
                self._may_start = False
                self._cancel_waiting(self._time())
                await self._final_flush(stored)
            self._wind_down(self._time())

    async def _exchange(self, stored: StoreRun) -> bool | None:
        """One batch with the store: write what was accepted and what ended, renew, claim.

        Returns whether the batch was a look (renewals, cancels, outcomes from
        elsewhere; join() waits for one), or None if it failed: then it has
        backed off, and the loop goes round again.
        """
        # Claim for every free slot, and some more to wait in the queue,
        # so that processors go on while the next batch commits: twice
        # the attempts that ended since the last batch (the rate at
        # which slots free up; twice, so that a starved pipeline grows),
        # at most _AHEAD capacities' worth. Slots that do not free up
        # (long handlers) make it claim nothing ahead, leaving the
        # queue's other work to other processes. Nothing is claimed while
        # a cancel() settles.
        ahead = min(2 * len(stored.outcomes), _AHEAD * self._capacity)
        free = self._capacity + ahead - self._in_flight - len(self._queue)
        claiming = self._may_start and not self._stop_called and not stored.holds
        claim = free if claiming and free > 0 else 0
        # Looks are scheduled on Trio's clock, never the wall clock: a step
        # of the wall clock must not stall the loop.
        batch, pending, outcomes = stored.build(self._lock, claim, self._time())
        # After a failed batch, each insert goes in a savepoint of its own:
        # a row the store refuses cannot hold back the others.
        batch.isolate = stored.failures > 0
        if not (batch.inserts or batch.outcomes or batch.claim or batch.renew):
            return False
        result = await self._try_batch(stored, batch, pending, outcomes)
        if result is None:
            delay = min(0.05 * 2 ** min(stored.failures, 10), 5.0)
            # A stop's deadline still holds: the final flush then keeps
            # trying to commit what was accepted.
            now = self._time()
            assert now is not None
            if self._stop_called and now >= self._stop_deadline:
                self._expire()
            await trio.sleep_until(min(now + delay, self._stop_deadline))
            return None
        stored.marked.update(batch.started)
        looked = batch.finished_since is not None
        if looked:
            # Overlapping looks: a clock step back loses nothing.
            assert stored.connection is not None
            stored.finals_since = result.now - stored.connection.finals_overlap
            stored.checks = stored.looks_begun  # one batch in flight at a time
        self._apply_batch(stored, result, pending, outcomes)
        return looked

    def _next_look(self, stored: StoreRun) -> float:
        """When, on Trio's clock, the store needs the loop next: a look, or a row falling due."""
        # next_check is on Trio's clock; next_due on the store's (see
        # BatchResult.shift), taken to Trio's through this instant's wall
        # clock, so that a step of the wall clock moves both ends.
        wake_at = stored.next_check
        room = self._capacity - self._in_flight - len(self._queue)
        if stored.next_due is not None and room > 0 and self._may_start:
            now = self._time()
            assert now is not None
            wake_at = min(wake_at, stored.next_due - stored.shift + now - wall_clock())
        return wake_at

    async def _listen(self, listening: Any, scope: trio.CancelScope) -> None:
        """Tickle the loop whenever the store says another process enqueued on this queue."""
        with scope:
            await listening.run(self._tickle)

    def _apply_batch(
        self,
        stored: StoreRun,
        result: BatchResult,
        pending: list[Pending],
        outcomes: list[Outcome],
    ) -> None:
        """A batch committed: give ids, finish tickets, take what was claimed."""
        now = self._time()
        assert now is not None
        to_trio = now - wall_clock()
        refused = result.refused
        if refused:
            pending = self._refused(stored, pending, refused, now)
            inserted = [pair for i, pair in enumerate(result.inserted) if i not in refused]
        else:
            inserted = result.inserted
        for entry, (request_id, new) in zip(pending, inserted, strict=True):
            ticket = entry[4]
            ticket.id = request_id
            if new:
                stored.tickets[request_id] = ticket
            else:
                # The key was live: this ticket follows that request. It was
                # counted as enqueued when accepted; it is a deduplicated call.
                self._deduplicated += 1
                self._last_id -= 1
                stored.watched.setdefault(request_id, []).append(ticket)
        if pending:
            stored.settled += len(pending)
            stored.committed.set()
            stored.committed = trio.Event()
            if self._submitters:
                self._room.unpark_all()
        for (kind, ticket, _, local), state in zip(outcomes, result.applied, strict=True):
            request_id = ticket.id
            stored.local.discard(request_id)
            if state is None:
                if kind != "handed_back" and kind != "returned" and not ticket.done:
                    # The lease had gone: another process runs the request.
                    stored.tickets.pop(request_id, None)
                    stored.watched.setdefault(request_id, []).append(ticket)
                    ticket.status = _QUEUED
                continue
            if state == "retrying":
                ticket.status = _RETRYING
                self._retried += 1
                continue
            if state == "queued":  # handed back
                ticket.status = _QUEUED
                continue
            stored.tickets.pop(request_id, None)
            if state == "cancelled":  # also a retry or hand-back whose cancel was asked for
                if kind in ("handed_back", "returned") and ticket in self._stopped_tickets:
                    self._stopped_tickets.remove(ticket)  # the stop handed back none of it
                kind = "cancelled"
            if kind == "succeeded":
                self._succeeded += 1
                self._finish(ticket, _SUCCEEDED, (now, local))
            elif kind == "cancelled":
                self._cancelled += 1
                self._finish(ticket, _CANCELLED, (now, None))
            else:
                exc, tb, context = local
                self._fail(ticket, exc, tb, now)
                self._call_on_error(ticket, exc, context)
            # Tickets of this process that follow the same request (a live key).
            for follower in stored.watched.pop(request_id, ()):
                self._finish(follower, ticket.status, ticket._state)
        if result.mine is not None:
            self._check_leases(stored, result.mine)
        for request_id in result.recent:
            # Final in the store, and not by this process's hand: a cancel, or
            # another process ran it. Fetch its outcome at the next look.
            elsewhere = stored.tickets.get(request_id)
            if elsewhere is not None and request_id not in stored.local and not elsewhere.done:
                del stored.tickets[request_id]
                stored.watched.setdefault(request_id, []).append(elsewhere)
                stored.next_check = -math.inf
        taken: list[Ticket[Any, Any]] = []
        for request_id, data, attempts, _, enqueued, _ in result.claimed:
            stored.local.add(request_id)
            known = stored.tickets.get(request_id)
            if known is None:
                try:
                    request = stored.codec.decode(data)
                except Exception as exc:
                    known = Ticket(None, request_id, _RUNNING, attempts, now, now, _EMPTY)
                    why = (type(exc).__name__, f"cannot decode the request: {exc}", "")
                    self._record("failed", known, (wall_clock(), *why), (exc, None, _EMPTY))
                    continue
                # Enqueued in the store's time, by another process: on Trio's clock,
                # no later than now (for the wait time histogram).
                enqueued_at = min(now, enqueued - result.shift + to_trio)
                known = Ticket(
                    request, request_id, _QUEUED, attempts - 1, enqueued_at, None, _EMPTY
                )
                stored.tickets[request_id] = known
            else:
                known.status = _QUEUED
                known.attempts = attempts - 1
            if not self._may_start:
                # Claimed by a batch that was under way when a stop began.
                self._record("returned", known, (wall_clock(),))
                continue
            taken.append(known)
        if taken:
            with self._lock:
                self._queue.extend(taken)
                self._peak = max(self._peak, len(self._queue))
        for row in result.finals:
            for ticket in stored.take_waiters(row.id):
                self._finish(ticket, *self._decoded(stored, row))
        for request_id in result.missing:
            lost = RequestFailed(
                "RowDeleted",
                "the request ended, but its row was deleted (retention) before this"
                " process read its outcome",
                "",
            )
            for ticket in stored.take_waiters(request_id):
                self._finish(ticket, _FAILED, (now, lost, None, None))

        stored.next_due = result.next_due
        stored.shift = result.shift
        stored.live = result.live

    def _refused(
        self, stored: StoreRun, pending: list[Pending], refused: dict[int, str], now: float
    ) -> list[Pending]:
        """Requests whose insert the store refused in an isolated batch; the others, in order.

        A refused request goes into the next batch once more (the refusal
        may have been a passing fault: a deadlock, a timeout); refused again,
        its ticket fails with StoreError, which names the store's error.
        """
        kept: list[Pending] = []
        again: list[Pending] = []
        failed = False
        for position, entry in enumerate(pending):
            error = refused.get(position)
            if error is None:
                kept.append(entry)
                continue
            ticket = entry[4]
            if stored.refused_once.pop(ticket, None) is None:
                stored.refused_once[ticket] = error
                again.append(entry)
                continue
            logger.error("service %r: the store refused a request (%s)", self.name, error)
            stored.settled += 1
            self._fail(ticket, StoreError(f"the store refused the request: {error}"), None, now)
            failed = True
        if failed:
            stored.committed.set()  # submit() raises the ticket's error
            stored.committed = trio.Event()
        if again:
            with self._lock:
                stored.pending[:0] = again
            self._tickle()
        return kept

    @staticmethod
    def _decoded(stored: StoreRun, row: Row) -> tuple[Status, tuple[Any, ...]]:
        """A final row as a ticket's status and final state (FAILED if it cannot be decoded)."""
        try:
            status, final = stored.decode_row(row)
        except Exception as exc:
            return _FAILED, (row.finished_at, exc, exc.__traceback__, None)
        return status, final

    def _check_leases(self, stored: StoreRun, mine: dict[int, bool]) -> None:
        """Take away attempts whose lease is gone or whose request was cancelled."""
        for request_id in list(stored.scopes):
            if request_id not in mine:
                stored.withdraw(request_id, "lost")
            elif mine[request_id]:
                stored.withdraw(request_id, "cancelled")
        # Claimed but not started yet.
        with self._lock:
            waiting = list(self._queue)
            keep = [t for t in waiting if t.id in mine and not mine[t.id]]
            if len(keep) != len(waiting):
                self._queue.clear()
                self._queue.extend(keep)
        for ticket in waiting:
            if ticket.id not in mine:
                stored.tickets.pop(ticket.id, None)
                stored.local.discard(ticket.id)
                stored.watched.setdefault(ticket.id, []).append(ticket)
            elif mine[ticket.id]:
                self._drop_claimed(stored, ticket)
        # Rows the store says this process holds, though it never learned it
        # claimed them: a claim committed whose reply was lost with the
        # connection. Renewals would keep them for ever: give them back.
        for request_id in mine.keys() - stored.local:
            orphan: Ticket[Any, Any] = Ticket(None, request_id, _RUNNING, 0, None, None, _EMPTY)
            stored.outcomes.append(("returned", orphan, (wall_clock(),), None))

    def _drop_claimed(self, stored: StoreRun, ticket: Ticket[Any, Any]) -> None:
        """A request claimed here, whose cancel was asked for before it started.

        Returned, it ends CANCELLED in the store (its cancel was asked for)
        with the claim's attempt undone: it never ran.
        """
        stored.outcomes.append(("returned", ticket, (wall_clock(),), None))
        self._tickle()

    async def _try_batch(
        self,
        stored: StoreRun,
        batch: Batch,
        pending: list[Pending],
        outcomes: list[Outcome],
    ) -> BatchResult | None:
        """Run a batch; if it fails, put its work back, count and log it, and return None."""
        try:
            result = await stored.run_batch(self.name, batch)
        except BaseException as exc:
            # Nothing accepted is dropped: it goes into the next try, or into
            # the final flush if the run is ending.
            stored.put_back(self._lock, pending, outcomes)
            if not isinstance(exc, Exception):
                raise
            stored.failures += 1
            stored.errors += 1
            stored.last_error = _one_line(exc)
            logger.error(
                "service %r: writing to the store failed (%s); %d failure(s) in a row",
                self.name,
                stored.last_error,
                stored.failures,
            )
            return None
        stored.failures = 0
        return result

    async def _final_flush(self, stored: StoreRun) -> None:
        """Commit what was accepted and write what ended, shielded; then close the store."""
        with trio.CancelScope(shield=True):
            for attempt in range(20):
                batch, pending, outcomes = stored.build(self._lock, 0, self._time())
                batch.renew, batch.watched, batch.prune = False, (), False
                if not batch.inserts and not batch.outcomes:
                    break
                result = await self._try_batch(stored, batch, pending, outcomes)
                if result is None:
                    await trio.sleep(min(0.05 * 2**attempt, 2.0))
                    continue
                self._apply_batch(stored, result, pending, outcomes)
            else:
                logger.error(
                    "service %r: %d accepted requests could not be committed",
                    self.name,
                    len(stored.pending),
                )
                # They exist nowhere else: their tickets fail, and say why.
                with self._lock:
                    lost, stored.pending = stored.pending, []
                    stored.settled += len(lost)
                now = self._time()
                for entry in lost:
                    error = StoreError(
                        f"service {self.name!r}: the request could not be committed to the"
                        f" store before the run ended ({stored.last_error})"
                    )
                    self._fail(entry[4], error, None, now)
            stored.committed.set()
            connection, stored.connection = stored.connection, None
            if connection is not None:
                await trio.to_thread.run_sync(connection.close, limiter=stored.limiter)

    async def _supervise(self, stored: StoreRun | None) -> None:
        """The one supervisor loop: exchange a batch with the store, dispatch, check a stop, sleep.

        It sleeps on the one-slot signal until tickled (an enqueue, an attempt
        that ended), until the next retry or delayed request falls due, until
        the stop's deadline, and with a store until its next look or the next
        row falling due. The in-memory engine has no batch to exchange.
        """
        assert self._signal_rx is not None
        receive = self._signal_rx.receive
        heap = self._heap
        try:
            while True:
                if self._incoming:
                    self._schedule_incoming()
                looked = False
                if stored is not None:
                    exchanged = await self._exchange(stored)
                    if exchanged is None:
                        continue  # the batch failed, and the loop backed off
                    looked = exchanged
                dispatched_at = self._dispatch()
                if self._stop_called:
                    if self._drained(stored):
                        self._release_idle()
                        return
                    now = self._time()
                    assert now is not None
                    if now >= self._stop_deadline:
                        self._expire()
                    elif self._insiders:
                        self._check_quiet()
                if not self._queue:
                    # Nothing waits: keep no enqueuer's context alive for sharing.
                    self._last_context = None
                # (With a store, join() also waits for a fresh look.)
                if self._idle_event is not None and (looked or self._is_idle()):
                    self._idle_event.set()
                    self._idle_event = None
                # What was due when _dispatch looked and did not start waits
                # for a slot, and a completion will tickle: only what falls
                # due after that instant needs the timer. (Compared with that
                # very instant: a later reading would miss a request that
                # fell due in between.)
                wake_at = self._stop_deadline
                if heap and self._may_start and heap[0][0] > dispatched_at:
                    wake_at = min(wake_at, heap[0][0])
                if stored is not None:
                    wake_at = min(wake_at, self._next_look(stored))
                await self._sleep(receive, wake_at)
        except BaseException:
            # Cancelled with the run, or the run is ending: from this instant
            # no processor starts another request.
            self._may_start = self._draining = False
            raise

    def _drained(self, stored: StoreRun | None) -> bool:
        """Whether a stop has nothing left: nothing waits, runs, or waits to be written."""
        return (
            not self._queue
            and not self._heap
            and not self._incoming
            and self._in_flight == 0
            and (stored is None or not stored.has_work())
        )

    async def _sleep(self, receive: Callable[[], Awaitable[None]], wake_at: float) -> None:
        """Sleep until tickled through the one-slot channel, or until ``wake_at``."""
        if wake_at < math.inf:
            with trio.move_on_at(wake_at):
                await receive()
                self._wakeup_pending = False
        else:
            await receive()
            self._wakeup_pending = False
        self._wakeups += 1
        self._debug = logger.isEnabledFor(logging.DEBUG)

    def _expire(self) -> None:
        """The stop's deadline has passed: cancel everything that is left."""
        self._draining = False
        self._may_start = False
        self._cancel_waiting(self._time())
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    def _dispatch(self) -> float:
        """Start a processor into every free slot, due retries first; return the time used."""
        if not self._may_start:
            return -math.inf
        limiter = self._limiter
        nursery = self._nursery
        assert nursery is not None
        timer = self._timer
        assert timer is not None
        now = self._offset + timer()
        process = self._process_withdrawable
        while limiter.borrowed_tokens < limiter.total_tokens:
            ticket = self._take(now)
            if ticket is None:
                return now
            slot = _Slot(ticket.id)
            # Handed to a processor that has yet to start it: cancel() finds it here.
            self._handed[ticket.id] = ticket
            limiter.acquire_on_behalf_of_nowait(slot)
            if self._idle:
                # A parked processor takes the start: no task spawn.
                parked = self._idle.pop()
                parked.handed = (ticket, slot)
                trio.lowlevel.reschedule(parked.task)
            else:
                # Processors start in an empty context of their own.
                _EMPTY_CONTEXT.copy().run(nursery.start_soon, process, ticket, slot)
            if self._debug:
                logger.debug("replenished: now %d/%d slots in use", self._in_flight, self._capacity)
        if self._debug and (self._queue or (self._heap and self._heap[0][0] <= now)):
            logger.debug(
                "received loop signal, but request limit is reached"
                " (%d/%d slots in use, %d queued)",
                self._in_flight,
                self._capacity,
                len(self._queue),
            )
        return now

    def _release_idle(self) -> None:
        """Tell every parked processor to exit."""
        idle = self._idle
        while idle:
            trio.lowlevel.reschedule(idle.pop().task)

    @trio.lowlevel.enable_ki_protection
    def _cancel_waiting(self, now: float | None) -> None:
        """Cancel every request that is queued, scheduled or waiting for a retry."""
        with self._lock:
            waiting = list(self._queue)
            self._peak = max(self._peak, len(waiting))
            self._queue.clear()
            self._last_context = None
            waiting.extend(ticket for _, ticket in self._incoming)
            self._scheduled -= len(self._incoming)
            self._incoming.clear()
            self._set_admit()
        for ticket in waiting:
            self._cancel(ticket, now)
        heap = self._heap
        while heap:
            ticket = heapq.heappop(heap)[2]
            if ticket.status is _SCHEDULED:
                self._unschedule()
            else:
                self._retrying -= 1
            self._cancel(ticket, now)

    def _close(self) -> None:
        """Refuse every enqueue from now on; submit() callers waiting for room get ServiceClosed."""
        with self._lock:
            self._closed = True
            self._admit = 0
        self._room.unpark_all()

    @trio.lowlevel.enable_ki_protection
    def _wind_down(self, now: float | None) -> None:
        self._draining = False
        self._close()
        self._may_start = False
        self.stopping.set()
        self._cancel_waiting(now)
        if self._signal_tx is not None:
            self._signal_tx.close()
        self._stopped_tickets.sort(key=_by_id)
        self._quiet.set()
        if self._idle_event is not None:
            self._idle_event.set()
        self._finished.set()

    def _check_quiet(self) -> None:
        """Wake stops called from handlers once nothing else can run before they return.

        That is when only requests whose handlers are in stop() still run, and
        either nothing waits, or they hold every slot: what waits then drains
        once they return.
        """
        if self._in_flight <= len(self._insiders) and (
            (not self._queue and not self._heap and not self._incoming)
            or self._in_flight >= self._capacity
        ):
            self._quiet.set()

    def _is_idle(self) -> bool:
        stored = self._store_run
        if stored is not None:
            # With a store: nothing waits here, and at the last batch nothing
            # of the queue was live in the store, in any process.
            return (
                not stored.has_work()
                and not self._queue
                and self._in_flight == 0
                and stored.live == 0
                and not stored.watched
                and not stored.committing
            )
        return not self._queue and not self._heap and not self._incoming and self._in_flight == 0

    async def cancel(self, id_or_key: int | Hashable) -> bool:
        """Cancel a live request, by its id (an int) or its key.

        A queued, scheduled or retrying request becomes CANCELLED at once.
        A running one has its handler cancelled: in memory at once, with a
        store in the process that runs it (within the store's
        ``poll_interval``). It is never retried. Requests this service
        accepted before the call are seen by it, as program order says.

        In memory, an attempt cancelled while running ends CANCELLED when
        the cancellation reaches it (at its next checkpoint); one that
        returns without reaching a checkpoint ends as it returned, and one
        that raises something else ends FAILED, not retried. With a store,
        a request whose cancel was asked for ends CANCELLED whatever its
        attempt does.

        Returns:
            Whether a live request with that id or key was found.

        Raises:
            TypeError: a key that is not hashable (with a store: not a str or
                a tuple of strs and ints).
            RuntimeError: called from a different Trio run than the service's.
        """
        if self._store_run is None:
            return await self._cancel_in_memory(id_or_key)
        stored = self._require_store("cancel")
        # Nothing is claimed meanwhile: a request enqueued just before must not
        # start between its commit and the cancel.
        stored.holds += 1
        try:
            await self._settle_accepted(stored)
            found, request_id = await self._in_store(
                stored.connection_for("cancel").cancel, id_or_key
            )
        finally:
            stored.holds -= 1
            self._tickle()
        if found:
            assert request_id is not None
            # Running here: no need to wait for the next look at the store.
            stored.withdraw(request_id, "cancelled")
            # Claimed here but not started: it never starts.
            with self._lock:
                claimed = [ticket for ticket in self._queue if ticket.id == request_id]
                for ticket in claimed:
                    self._queue.remove(ticket)
            for ticket in claimed:
                self._drop_claimed(stored, ticket)
            stored.next_check = -math.inf
            self._tickle()
        return found

    async def _cancel_in_memory(self, id_or_key: int | Hashable) -> bool:
        by_id = isinstance(id_or_key, int) and not isinstance(id_or_key, bool)
        if not by_id:
            _check_key(id_or_key)
        self._check_run("used")
        await trio.lowlevel.checkpoint_if_cancelled()
        found = bool(self._cancel_found(id_or_key, by_id))
        await trio.lowlevel.cancel_shielded_checkpoint()
        return found

    @trio.lowlevel.enable_ki_protection
    def _cancel_found(self, id_or_key: object, by_id: bool) -> bool | None:
        """Cancel the live request if found waiting or running (True); else None."""
        now = self._time()
        if now is None:  # before the run: as a stop then, on the caller's clock
            now = trio.current_time()
        ticket: Ticket[RequestT, ResultT] | None = None
        removed: Ticket[RequestT, ResultT] | None = None
        with self._lock:
            if by_id:
                for candidate in self._queue:
                    if candidate.id == id_or_key:
                        ticket = candidate
                        break
            else:
                ticket = self._keys.get(id_or_key)
            if ticket is not None and ticket.status is _QUEUED:
                try:
                    self._queue.remove(ticket)
                except ValueError:
                    return None  # taken by a processor, about to start
                removed = ticket
            else:
                for index, (_, entry) in enumerate(self._incoming):
                    if entry is ticket or (by_id and ticket is None and entry.id == id_or_key):
                        del self._incoming[index]
                        self._scheduled -= 1
                        self._set_admit()
                        removed = entry
                        break
        if removed is not None:
            # A queued request frees a place in the queue; a scheduled one
            # too (it counted against the bound).
            self._finish_cancelled(removed, now, frees_room=True)
            return True
        for index, (_, _, entry) in enumerate(self._heap):
            if entry is ticket or (by_id and ticket is None and entry.id == id_or_key):
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                if entry.status is _SCHEDULED:
                    self._unschedule()  # (which gives its place to a submit() waiter)
                else:
                    self._retrying -= 1
                self._finish_cancelled(entry, now)
                return True
        for attempt in list(_ATTEMPTS.values()):
            running = attempt.ticket
            if (
                attempt.service is self
                and running is not None
                and running.status is _RUNNING
                and (running is ticket or (by_id and ticket is None and running.id == id_or_key))
            ):
                if attempt.withdrawn is not running:
                    attempt.withdrawn = running
                    assert attempt.scope is not None
                    attempt.scope.cancel()
                    # Its key is free from now: a replacement enqueued next
                    # is a request of its own.
                    self._release_key(running)
                return True
        # Handed to a processor that has not started it: it never starts.
        if ticket is not None:
            handed = self._handed.get(ticket.id)
        else:
            handed = self._handed.get(id_or_key) if by_id else None  # type: ignore[call-overload]
        if handed is not None and (ticket is None or handed is ticket):
            del self._handed[handed.id]
            self._doomed.add(handed)
            self._release_key(handed)
            self._tickle()
            return True
        return None

    async def lookup(self, id_or_key: int | Hashable) -> Ticket[Any, Any] | None:
        """The request's state as the store has it, from any process; None if unknown.

        The ticket's times are the store's (seconds since the epoch); a
        failure's error is a :class:`tickler.RequestFailed` holding its type,
        message and traceback as text. For a key, the live request, else the
        latest one.
        """
        stored = self._require_store("lookup")
        await self._settle_accepted(stored)
        row = await self._in_store(stored.connection_for("lookup").lookup, id_or_key)
        if row is None:
            return None
        status = Status(row.state)
        try:
            request = stored.codec.decode(row.request)
        except Exception:
            request = None  # another codec's bytes: the ticket's state still holds
        ticket: Ticket[Any, Any] = Ticket(
            request, row.id, status, row.attempts, row.enqueued_at, row.started_at, _EMPTY
        )
        if status in FINAL:
            # (A result this codec cannot decode fails the ticket with the error.)
            ticket.status, ticket._state = self._decoded(stored, row)
        elif not self._finished.is_set():
            # The ticket follows the row to its final state, wherever it
            # runs: this process's looks at the store finish it (the next
            # look, within poll_interval, or at once if it runs here).
            stored.watched.setdefault(row.id, []).append(ticket)
        return ticket

    async def _settle_accepted(self, stored: StoreRun) -> None:
        """Wait until every request this service accepted so far is in the store.

        What the caller enqueued before a cancel or a lookup must be seen by
        it, as program order says, even though enqueues commit in batches.
        """
        with self._lock:
            wanted = stored.accepted
        if stored.settled >= wanted:
            return
        self._tickle()
        while stored.settled < wanted and not self._finished.is_set():
            await stored.committed.wait()

    async def store_statistics(self) -> dict[str, int]:
        """Exact counts of this service's queue in the store, by status, over every process."""
        stored = self._require_store("store_statistics")
        await self._settle_accepted(stored)
        return await self._in_store(stored.connection_for("store_statistics").statistics)

    def _require_store(self, what: str) -> StoreRun:
        stored = self._store_run
        if stored is None:
            raise RuntimeError(f"{what}() needs a service with a store")
        self._check_run("used")
        return stored

    async def _in_store(self, fn: Callable[..., _T], *args: Any) -> _T:
        stored = self._store_run
        assert stored is not None
        return await trio.to_thread.run_sync(fn, self.name, *args, limiter=stored.limiter)

    async def join(self) -> None:
        """Wait until nothing is queued, retrying or in flight; close nothing.

        Returns at once if the service is idle, and is always a checkpoint.
        Requests enqueued while it waits are waited for too. Before ``run``
        it waits for the run to take the queue; after the run has ended
        nothing is left and it returns.

        Raises:
            RuntimeError: called from one of the service's own handlers (it
                would wait for itself), or from a different Trio run.
        """
        token = self._check_run("joined")
        if token is not None and self._insider() is not None:
            raise RuntimeError(
                f"join() called from a handler of service {self.name!r} would wait for itself"
            )
        stored = self._store_run
        if stored is not None and token is not None:
            # What the last look at the store saw may be stale: take a fresh
            # one first, and trust only looks taken after the call.
            # (A look already under way may have begun before a commit
            # this caller made: wait for one begun after the call.)
            wanted = stored.looks_begun + 1
            stored.next_check = -math.inf
            self._tickle()
            while stored.checks < wanted and not self._finished.is_set():
                await self._idle_event_or_new().wait()
        while not (self._is_idle() or self._finished.is_set()):
            self._bind()
            await self._idle_event_or_new().wait()
        await trio.lowlevel.checkpoint()

    def _own_request(self) -> int | None:
        """The id of the request whose handler (or a task it spawned) is calling, if any."""
        insider = self._insider()
        if insider is None:
            return None
        attempt = _ATTEMPTS.get(insider)
        return attempt.ticket.id if attempt is not None and attempt.ticket is not None else None

    def _idle_event_or_new(self) -> trio.Event:
        """The event the loop sets once idle; with a store, also after each look at the store."""
        event = self._idle_event
        if event is None:
            event = self._idle_event = trio.Event()
            self._tickle()
        return event

    async def stop(
        self, *, drain: bool = True, timeout: float | None = None
    ) -> list[Ticket[RequestT, ResultT]]:
        """Stop the service and return the tickets that did not complete.

        Enqueueing is refused from the first instant. With ``drain=True`` the
        service keeps starting queued requests and due retries until nothing
        is queued, retrying or in flight; with ``drain=False`` it starts
        nothing more and cancels what is queued or retrying at once. Either way
        it then waits for what runs, up to ``timeout`` seconds (``None``: no
        limit; ``0``: not at all), and cancels what still runs.

        The first call decides ``drain`` and ``timeout``, and the deadline
        belongs to the stop, not to that call: cancelling the caller does not
        cancel the stop. Concurrent and later calls wait for the same stop and
        return the same tickets.

        Called from inside one of the service's own handlers (or a task a
        handler spawned), it waits for everything except the requests whose
        handlers are in ``stop()``, and returns the tickets cancelled so far.

        Returns:
            Every ticket that did not complete, marked CANCELLED, by id.

        Raises:
            RuntimeError: called from a different Trio run than the service's.
        """
        if not isinstance(drain, bool):
            raise TypeError("drain must be a bool")
        limit = _check_timeout("timeout", timeout, allow_zero=True)
        token = self._check_run("stopped")
        if not self._closed:
            self._stop_called = True
            self._close()
            self.stopping.set()
            if token is None:
                self._wind_down(trio.current_time())
            else:
                now = self._time()
                assert now is not None
                if limit is not None:
                    self._stop_deadline = now + limit
                if drain:
                    self._draining = True
                else:
                    self._may_start = False
                    self._cancel_waiting(now)
                    if self._store_run is not None:
                        # With a store, what runs goes back to the store at
                        # once; but for a caller's own attempt (see below).
                        own = self._own_request()
                        for request_id in list(self._store_run.scopes):
                            if request_id != own:
                                self._store_run.withdraw(request_id, "handback")
                self._tickle()
        insider = self._insider() if token is not None else None
        if insider is None:
            await self._finished.wait()
        else:
            self._insiders[insider] += 1
            try:
                if self._quiet.is_set() and not self._finished.is_set():
                    self._quiet = trio.Event()
                self._tickle()
                await self._quiet.wait()
            finally:
                self._insiders[insider] -= 1
                if not self._insiders[insider]:
                    del self._insiders[insider]
        if self._finished.is_set():
            return list(self._stopped_tickets)  # sorted once, when the run ended
        return sorted(self._stopped_tickets, key=_by_id)


def _by_id(ticket: Ticket[Any, Any]) -> int:
    return ticket.id
