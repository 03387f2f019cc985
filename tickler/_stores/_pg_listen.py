"""PostgresStore's Listener: LISTEN on the libpq socket, woken by trio.lowlevel.wait_readable."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    import psycopg

logger = logging.getLogger("tickler")


class Listener:
    """LISTEN on a connection of its own, in the Trio thread; calls ``wake`` per notification.

    Connecting and the LISTEN run on a worker thread; the wait for
    notifications is ``trio.lowlevel.wait_readable`` on the connection's
    socket, then ``psycopg.pq`` reads them: no thread hop between a NOTIFY
    and the loop (see docs/performance.md for the measurement). A lost connection is
    opened again every second, with a WARNING when it is lost and one when
    it listens again; the poll covers whatever was notified meanwhile.
    """

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        channel: str,
        queue: str,
        poll_interval: float,
    ) -> None:
        self.connect = connect
        self.channel = channel
        self.queue = queue
        self.poll_interval = poll_interval

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg
        import psycopg.sql

        listen = psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(self.channel))
        db = self.connect()
        try:
            db.execute(listen)
        except BaseException:
            db.close()
            raise
        return db

    async def run(self, wake: Callable[[], None]) -> None:
        """Listen until cancelled."""
        import psycopg

        lost: str | None = None  # why the last connection failed, until one listens again
        queue = self.queue.encode()
        while True:
            try:
                db = await trio.to_thread.run_sync(self._connect)
            except psycopg.Error as exc:
                lost = self._lost(lost, exc)
                await trio.sleep(1.0)
                continue
            pgconn = db.pgconn
            socket = pgconn.socket
            try:
                if lost is not None:
                    logger.warning("service %r: listening for NOTIFY again", self.queue)
                    lost = None
                wake()  # what was notified before the LISTEN, or while it was lost
                while True:
                    await trio.lowlevel.wait_readable(socket)
                    pgconn.consume_input()  # raises once the connection is lost
                    while (notice := pgconn.notifies()) is not None:
                        if notice.extra == queue:
                            wake()
            except psycopg.Error as exc:
                lost = self._lost(lost, exc)
            finally:
                with trio.CancelScope(shield=True):
                    trio.lowlevel.notify_closing(socket)
                    await trio.to_thread.run_sync(db.close)
            await trio.sleep(1.0)  # (only a lost connection gets here)

    def _lost(self, lost: str | None, exc: Exception) -> str:
        if lost is None:
            lost = " ".join(str(exc).split()) or type(exc).__name__
            logger.warning(
                "service %r: the NOTIFY connection failed (%s); trying again every"
                " second, and polling every %s s meanwhile",
                self.queue,
                lost,
                self.poll_interval,
            )
        return lost
