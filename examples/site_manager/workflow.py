"""The provisioning workflow: idempotent steps, each a tickler request.

Each step reads the site's status first, skips what is already done, aborts
without error once the site is no longer ``creating``, and enqueues the steps
that follow it. Slow, failure-prone work goes through a :class:`Backend`
whose latency and failure rate can be set; its failures are retried by
tickler's :class:`~tickler.Retry`.
"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import trio

import tickler

from .store import Store


class BackendError(Exception):
    """A simulated transient failure of the provisioning backend."""


@attrs.frozen
class Step:
    """One tickler request: run ``name`` for site ``site_id``."""

    name: str
    site_id: int


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


# What each creation step enqueues once it is done: fs and db in parallel
# after the metadata, the bootstrap once the database exists, and a final
# check after the last of them.
FOLLOWERS = {
    "metadata": ("fs", "db"),
    "fs": ("finish",),
    "db": ("bootstrap",),
    "bootstrap": ("finish",),
}


# The status flag each creation step sets.
FLAG_OF = {
    "metadata": "metadata_ready",
    "fs": "fs_ready",
    "db": "db_ready",
    "bootstrap": "bootstrapped",
}


def next_steps(status: dict[str, Any]) -> list[Step]:
    """The steps that move a site on from its status flags."""
    site_id = status["id"]
    if status["state"] == "deleting":
        return [Step("delete", site_id)]
    if status["state"] != "creating":
        return []
    if not status["metadata_ready"]:
        return [Step("metadata", site_id)]
    steps = []
    if not status["fs_ready"]:
        steps.append(Step("fs", site_id))
    if not status["db_ready"]:
        steps.append(Step("db", site_id))
    elif not status["bootstrapped"]:
        steps.append(Step("bootstrap", site_id))
    return steps or [Step("finish", site_id)]


def enqueue_steps(service: tickler.Service[Step, None], steps: Iterable[Step]) -> None:
    """Enqueue steps, each keyed by itself.

    A step that is already queued, scheduled, running or retrying is not
    enqueued twice: "finish" follows both "fs" and "bootstrap", and a retried
    step enqueues its followers again. A full queue raises QueueFull, which
    the retry policy retries.
    """
    for step in steps:
        service.enqueue_request(step, key=step)


@attrs.define(eq=False)
class Workflow:
    """The tickler handler: runs one step of one site's workflow."""

    store: Store
    data: Path
    backend: Backend
    # Steps of one site run one at a time, so a delete never races a creation step.
    _locks: dict[int, trio.Lock] = attrs.field(factory=dict)

    def site_dir(self, site_id: int) -> Path:
        return self.data / "sites" / str(site_id)

    def site_db(self, site_id: int) -> Path:
        return self.data / "databases" / f"{site_id}.sqlite3"

    def metadata_file(self, site_id: int) -> Path:
        return self.data / "metadata" / f"{site_id}.json"

    async def __call__(self, step: Step) -> None:
        lock = self._locks.setdefault(step.site_id, trio.Lock())
        async with lock:
            status = await self.store.get(step.site_id)
            if status is None:
                return
            if step.name == "delete":
                await self._delete(status)
                return
            if status["state"] != "creating":
                return  # deleted or deleting meanwhile: abort, leave nothing behind
            if step.name == "finish":
                await self.store.mark_running(step.site_id)
                return
            await self.store.count_attempt(step.site_id, step.name)
            await self._create(step.name, status)
        enqueue_steps(
            tickler.current_service(), (Step(n, step.site_id) for n in FOLLOWERS[step.name])
        )

    async def _create(self, step: str, status: dict[str, Any]) -> None:
        """Do one creation step unless its flag is set, then set the flag."""
        flag = FLAG_OF[step]
        if status[flag] or (step == "bootstrap" and not status["db_ready"]):
            return
        await self.backend.call()
        await trio.to_thread.run_sync(getattr(self, f"_{step}"), status)
        await self.store.set_flag(status["id"], flag)

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
        await self.store.count_attempt(status["id"], "delete")
        await self.backend.call()
        site_id = status["id"]

        def remove() -> None:
            shutil.rmtree(self.site_dir(site_id), ignore_errors=True)
            for path in (self.site_db(site_id), self.metadata_file(site_id)):
                path.unlink(missing_ok=True)
            for suffix in ("-wal", "-shm", "-journal"):
                Path(f"{self.site_db(site_id)}{suffix}").unlink(missing_ok=True)

        await trio.to_thread.run_sync(remove)
        await self.store.mark_deleted(site_id)
        self._locks.pop(site_id, None)


BOOTSTRAP_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages (id INTEGER PRIMARY KEY, path TEXT UNIQUE, body TEXT);
CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, email TEXT UNIQUE);
"""
BOOTSTRAP_TABLES = ("pages", "users")
