"""The provisioning workflow: idempotent steps, each a tickler request.

Each step reads the site's status first, skips what is already done, aborts
without error once the site is no longer ``creating``, and enqueues the steps
that follow it. Slow, failure-prone work goes through a :class:`Backend`
whose latency and failure rate can be set; its failures are retried by
tickler's :class:`~tickler.Retry`.

A delete first cancels the site's live creation steps, wherever they run, and
waits until none is live (:func:`abort_creation`); only then does it remove
anything.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import trio

import tickler

from .store import Sites, Step

CREATION_STEPS = ("metadata", "fs", "db", "bootstrap")

# What each creation step enqueues once it is done: fs and db in parallel
# after the metadata, and the bootstrap once the database exists.
FOLLOWERS: dict[str, tuple[str, ...]] = {
    "metadata": ("fs", "db"),
    "fs": (),
    "db": ("bootstrap",),
    "bootstrap": (),
}

# The steps that end a branch: each marks the site running if every flag is
# set, so whichever of them ends last does.
LAST_STEPS = ("fs", "bootstrap")

# The status flag each creation step sets.
FLAG_OF = {
    "metadata": "metadata_ready",
    "fs": "fs_ready",
    "db": "db_ready",
    "bootstrap": "bootstrapped",
}


class BackendError(Exception):
    """A simulated transient failure of the provisioning backend."""


@attrs.define
class Backend:
    """Where the slow work happens: a delay and a chance of failure before each action."""

    latency: float = 0.0
    fail_rate: float = 0.0
    rng: random.Random = attrs.Factory(random.Random)

    async def call(self) -> None:
        if self.latency:
            await trio.sleep(self.rng.uniform(0, self.latency))
        else:
            await trio.lowlevel.checkpoint()
        if self.rng.random() < self.fail_rate:
            raise BackendError("the provisioning backend failed; try again")


@attrs.define(eq=False)
class StepLog:
    """One line per event, appended to a file every replica shares (or nowhere).

    ``<monotonic ns> <pid> <event> <site id> <step>``: ``start`` when an
    attempt begins, then ``ok``, ``error`` or ``cancelled`` when it ends;
    ``cancel`` when a delete is about to cancel the step; ``aborted`` once a
    delete's cancels have returned and no creation step of the site is live
    (``<step>`` says who waited: ``request`` or ``delete``).
    The monotonic clock is the machine's, so replicas on one host compare.
    """

    path: Path | None = None
    _fd: int | None = None

    def write(self, event: str, site_id: int, step: str) -> None:
        if self.path is None:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = f"{time.monotonic_ns()} {os.getpid()} {event} {site_id} {step}\n"
        os.write(self._fd, line.encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def enqueue_steps(service: tickler.Service[str, None], steps: Iterable[Step]) -> None:
    """Enqueue steps, each keyed by itself.

    A step that is already queued, scheduled, running or retrying, in any
    replica, is not enqueued twice: a step re-run after its replica died
    enqueues its followers again. A full queue raises QueueFull, which the
    retry policy retries.
    """
    for step in steps:
        service.enqueue_request(step.key, key=step.key)


async def abort_creation(
    service: tickler.Service[str, None],
    site_id: int,
    *,
    poll: float = 0.02,
    log: StepLog | None = None,
) -> None:
    """Cancel the site's live creation steps, wherever they run; return once none is live.

    Call it once the site is `deleting`: from then on a step that starts
    reads that state and stops without enqueueing anything, so new creation
    steps come only from steps live now. A step enqueues its followers before
    it is final (they are committed with its outcome, or earlier). So a pass
    over the steps in workflow order that finds none live proves that none
    will be again. A pass that cancels some waits until each is final (a
    running one is cancelled by its replica within the store's poll interval,
    a lost one once its lease expires), then looks again.
    """
    while True:
        cancelled = []
        for name in CREATION_STEPS:
            key = Step(site_id, name).key
            if log is not None:
                log.write("cancel", site_id, name)
            if await service.cancel(key):
                cancelled.append(key)
        if not cancelled:
            return
        for key in cancelled:
            while (ticket := await service.lookup(key)) is not None and not ticket.done:
                await trio.sleep(poll)


@attrs.define(eq=False)
class Workflow:
    """The tickler handler: runs one step of one site's workflow."""

    sites: Sites
    data: Path
    backend: Backend
    log: StepLog = attrs.Factory(StepLog)

    def site_dir(self, site_id: int) -> Path:
        return self.data / "sites" / str(site_id)

    def site_db(self, site_id: int) -> Path:
        return self.data / "databases" / f"{site_id}.sqlite3"

    def metadata_file(self, site_id: int) -> Path:
        return self.data / "metadata" / f"{site_id}.json"

    async def __call__(self, request: str) -> None:
        step = Step.parse(request)
        self.log.write("start", step.site_id, step.name)
        ended = "error"
        try:
            await self._run(step)
            ended = "ok"
        except trio.Cancelled:
            ended = "cancelled"
            raise
        finally:
            self.log.write(ended, step.site_id, step.name)

    async def _run(self, step: Step) -> None:
        status = await self.sites.get(step.site_id)
        if status is None:
            return
        if step.name == "delete":
            await self._delete(status)
            return
        if status["state"] != "creating":
            return  # deleted or deleting meanwhile: abort, leave nothing behind
        flag = FLAG_OF[step.name]
        if not status[flag]:
            await self.backend.call()
            await trio.to_thread.run_sync(getattr(self, f"_{step.name}"), status)
            await self.sites.set_flag(step.site_id, flag)
        if step.name in LAST_STEPS:
            await self.sites.mark_running(step.site_id)
        enqueue_steps(
            tickler.current_service(), (Step(step.site_id, n) for n in FOLLOWERS[step.name])
        )

    # The work of each creation step, run in a worker thread.

    def _metadata(self, status: dict[str, Any]) -> None:
        path = self.metadata_file(status["id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"name": status["name"], "domain": status["domain"]}))

    def _fs(self, status: dict[str, Any]) -> None:
        self.site_dir(status["id"]).mkdir(parents=True, exist_ok=True)

    def _db(self, status: dict[str, Any]) -> None:
        path = self.site_db(status["id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        sqlite3.connect(path).close()

    def _bootstrap(self, status: dict[str, Any]) -> None:
        connection = sqlite3.connect(self.site_db(status["id"]))
        try:
            connection.executescript(BOOTSTRAP_SCHEMA)
        finally:
            connection.close()

    async def _delete(self, status: dict[str, Any]) -> None:
        if status["state"] != "deleting":
            return
        site_id = status["id"]
        await abort_creation(tickler.current_service(), site_id, log=self.log)
        self.log.write("aborted", site_id, "delete")
        await self.backend.call()

        def remove() -> None:
            shutil.rmtree(self.site_dir(site_id), ignore_errors=True)
            for path in (self.site_db(site_id), self.metadata_file(site_id)):
                path.unlink(missing_ok=True)
            for suffix in ("-wal", "-shm", "-journal"):
                Path(f"{self.site_db(site_id)}{suffix}").unlink(missing_ok=True)

        await trio.to_thread.run_sync(remove)
        await self.sites.mark_deleted(site_id)


BOOTSTRAP_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages (id INTEGER PRIMARY KEY, path TEXT UNIQUE, body TEXT);
CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, email TEXT UNIQUE);
"""
BOOTSTRAP_TABLES = ("pages", "users")
