"""The supervisor: the run of a service, and its one loop.

``run`` opens the store (if any), starts the nursery the processors run in,
and runs :meth:`Supervisor.supervise` until a stop is done; whatever ends
the run, it then commits what was accepted and hands back what was claimed.
Each turn of the loop exchanges one batch with the store if there is one,
dispatches into the free slots, checks the stop, and sleeps on the one-slot
signal until tickled or until the next due time.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from . import _lowlevel
from ._core import _get_ident, logger, wall_clock
from ._engine import _Engine
from ._exceptions import QueueFull, ServiceClosed, service_closed
from ._intake import Intake
from ._periodic import Periodic
from ._stopping import Stopping
from ._stores._sync import StoreSync
from ._values import Tick


@attrs.define(eq=False)
class Supervisor:
    """The run and its loop; counts the loop's wake-ups."""

    engine: _Engine[Any, Any]
    intake: Intake
    stopping: Stopping
    sync: StoreSync | None
    periodic: tuple[Periodic, ...] = ()
    wakeups: int = 0
    # The next tick of each periodic request, in seconds since the epoch; and
    # the wall clock as read from Trio's (wall, Trio) at the run's start.
    next_ticks: dict[str, float] = attrs.Factory(dict)
    anchor: tuple[float, float] = (0.0, 0.0)
    # With a store: each periodic request as the store keeps it.
    encoded: dict[str, bytes] = attrs.Factory(dict)

    def start_ticks(self, trio_now: float) -> None:
        """Schedule every periodic request's next tick; with a store, ask for a catch-up run.

        The wall clock of the ticks is read from Trio's clock, anchored to
        time.time() once per run: a step of the wall clock moves no tick, and
        in tests a virtual clock moves them all.
        """
        wall = time.time()
        self.anchor = (wall, trio_now)
        for each in self.periodic:
            self.next_ticks[each.name] = each.next_tick(wall)
            if self.sync is not None:
                # A tick missed while no replica ran: one run for all of them,
                # if the store has seen the schedule before (see Batch.ticks).
                data = self.encoded[each.name]
                self.sync.ticks.append(
                    Tick(each.name, each.last_tick(wall), True, data, each.priority)
                )

    def tick(self, trio_now: float) -> float:
        """Enqueue the periodic requests whose tick has come; return Trio's time of the next."""
        engine = self.engine
        wall = self.anchor[0] + (trio_now - self.anchor[1])
        for each in self.periodic:
            if self.next_ticks[each.name] > wall or engine._closed:
                continue
            tick = each.last_tick(wall)  # ticks missed meanwhile collapse into this one
            self.next_ticks[each.name] = each.next_tick(wall)
            if self.sync is not None:
                data = self.encoded[each.name]
                self.sync.ticks.append(Tick(each.name, tick, False, data, each.priority))
                continue
            try:
                if engine._tracer is None:
                    self.intake.enqueue_keyed(each.request, None, None, each.priority)
                else:  # a tick starts a trace of its own
                    engine._tracer.periodic(
                        functools.partial(
                            self.intake.enqueue_keyed, each.request, None, None, each.priority
                        )
                    )
            except (QueueFull, ServiceClosed) as exc:
                logger.warning(
                    "service %r: the tick of periodic request %r was refused: %s",
                    engine.name,
                    each.name,
                    exc,
                )
        if not self.next_ticks:
            return math.inf
        return self.anchor[1] + (min(self.next_ticks.values()) - self.anchor[0])

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Service.run (see its docstring): open the store, then the loop, until a stop."""
        engine, intake, stopping = self.engine, self.intake, self.stopping
        if stopping.stop_called and engine._token is None:
            raise service_closed(engine.name)
        if engine._token is not None:
            raise RuntimeError(f"service {engine.name!r} has already run")
        if engine._bound is not None and engine._bound is not trio.lowlevel.current_trio_token():
            raise RuntimeError(
                f"service {engine.name!r} was waited on from another Trio run before it ran;"
                " run it in that one"
            )
        stored = self.sync
        if stored is not None:
            # Open and check the store before anything starts: a bad file
            # raises StoreError from here, with nothing written.
            stored.connection = await trio.to_thread.run_sync(stored.store.connect)
            stored.finals_since = wall_clock()
        engine._signal_tx, engine._signal_rx = trio.open_memory_channel[None](1)
        clock = trio.lowlevel.current_clock()
        now = clock.current_time()
        with engine._lock:
            engine._token = trio.lowlevel.current_trio_token()
            engine._thread = _get_ident()
            # The offset first: a thread that sees the timer sees its offset.
            engine._timer, engine._offset = None, _lowlevel.clock_offset(clock)
            engine._timer = time.perf_counter if engine._offset else clock.current_time
            for ticket in engine._queue:
                ticket.enqueued_at = now
            for _, ticket in intake.incoming:
                ticket.enqueued_at = now
            if stored is not None:
                for pending in stored.pending:
                    pending.ticket.enqueued_at = now
            for _, _, _, ticket in engine._ready:
                ticket.enqueued_at = now
        if self.periodic:
            self.start_ticks(now)
        try:
            async with trio.open_nursery() as nursery:
                engine._nursery = nursery
                task_status.started()
                listener_scope = trio.CancelScope()
                if stored is not None:
                    listening = stored.store.listener(engine.name)
                    if listening is not None:
                        nursery.start_soon(stored.listen, listening, listener_scope)
                await self.supervise(stored)
                listener_scope.cancel()
        finally:
            if stored is not None:
                # Whatever ended the run, commit what was accepted and hand
                # back what was claimed: a stop never loses a request.
                stopping.close()
                engine._may_start = False
                stopping.cancel_waiting(engine._time())
                await stored.final_flush()
            stopping.wind_down(engine._time())

    async def supervise(self, stored: StoreSync | None) -> None:
        """The one supervisor loop: exchange a batch with the store, dispatch, check a stop, sleep.

        It sleeps on the one-slot signal until tickled (an enqueue, an attempt
        that ended), until the next retry or delayed request falls due, until
        the stop's deadline, and with a store until its next look or the next
        row falling due. The in-memory engine has no batch to exchange.
        """
        engine, intake, stopping = self.engine, self.intake, self.stopping
        assert engine._signal_rx is not None
        receive = engine._signal_rx.receive
        heap = engine._heap
        try:
            while True:
                if intake.incoming:
                    intake.schedule_incoming()
                tick_at = math.inf
                if self.periodic:
                    trio_now = engine._time()
                    assert trio_now is not None
                    tick_at = self.tick(trio_now)
                looked = False
                if stored is not None:
                    exchanged = await stored.exchange()
                    if exchanged is None:
                        continue  # the batch failed, and the loop backed off
                    looked = exchanged
                dispatched_at = engine._dispatch()
                if stopping.stop_called:
                    if engine._paused and engine._in_flight == 0:
                        # Paused, nothing more starts: a drain ends with what
                        # ran, and what waits is cancelled (with a store: stays).
                        stopping.cancel_waiting(engine._time())
                    if stopping.drained(stored):
                        stopping.release_idle()
                        return
                    now = engine._time()
                    assert now is not None
                    if now >= stopping.stop_deadline:
                        stopping.expire()
                    elif stopping.insiders:
                        stopping.check_quiet()
                if not engine._queue:
                    # Nothing waits: keep no enqueuer's context alive for sharing.
                    engine._last_context = None
                # (With a store, join() also waits for a fresh look.)
                if stopping.idle_event is not None and (looked or stopping.is_idle()):
                    stopping.idle_event.set()
                    stopping.idle_event = None
                # What was due when _dispatch looked and did not start waits
                # for a slot, and a completion will tickle: only what falls
                # due after that instant needs the timer. (Compared with that
                # very instant: a later reading would miss a request that
                # fell due in between.)
                # The one rule of the loop's next wake-up. Paused (or no more
                # starts), nothing that falls due may start, here or in the
                # store: no due time wakes the loop, which sleeps until a
                # tickle (an enqueue; a resume here), a tick, the stop's
                # deadline, or with a store its next look (which sees a pause
                # or resume from elsewhere).
                wake_at = min(stopping.stop_deadline, tick_at)
                if engine._may_start and not engine._paused:
                    if heap and heap[0][0] > dispatched_at:
                        wake_at = min(wake_at, heap[0][0])
                    if stored is not None:
                        wake_at = min(wake_at, stored.next_due_at())
                if stored is not None:
                    wake_at = min(wake_at, stored.next_check)
                await self.sleep(receive, wake_at)
        except BaseException:
            # Cancelled with the run, or the run is ending: from this instant
            # no processor starts another request.
            engine._may_start = engine._draining = False
            raise

    async def sleep(self, receive: Callable[[], Awaitable[None]], wake_at: float) -> None:
        """Sleep until tickled through the one-slot channel, or until ``wake_at``."""
        engine = self.engine
        if wake_at < math.inf:
            with trio.move_on_at(wake_at):
                await receive()
                engine._wakeup_pending = False
        else:
            await receive()
            engine._wakeup_pending = False
        self.wakeups += 1
        debug = logger.isEnabledFor(logging.DEBUG)
        if debug is not engine._debug:
            engine._debug = debug
            with engine._lock:
                self.intake.set_admit()
