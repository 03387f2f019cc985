"""The HTTP API (Starlette, served by Hypercorn's Trio worker) and the server's life cycle."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import prometheus_client
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import tickler
import tickler.prometheus

from .store import QUEUE, STEPS, DomainTaken, Sites, Step, TooManyPending, open_database
from .workflow import Backend, BackendError, StepLog, Workflow, abort_creation

MAX_NAME = 100
DNS_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
RETRY_AFTER = "1"


@attrs.frozen
class Settings:
    """How the service runs. The defaults suit a demo; tests shrink the delays.

    ``data`` holds the sites' files and, without ``postgres``, the SQLite
    file of the status table and tickler's queue. With ``postgres`` (a DSN)
    both live in that database instead, the status table in ``schema`` and
    the queue in ``<schema>_queue``, and any number of replicas share them.
    """

    data: Path
    postgres: str | None = None
    schema: str = "site_manager"
    host: str = "127.0.0.1"
    port: int = 8000
    fail_rate: float = 0.0
    latency: float = 0.05
    capacity: int = 16
    max_queue_length: int = 1000
    max_pending: int = 1000
    lease: float = 30.0
    poll_interval: float = 1.0
    retry_initial: float = 0.05
    retry_maximum: float = 2.0
    abort_timeout: float = 10.0
    shutdown_timeout: float = 5.0
    seed: int | None = None
    step_log: Path | None = None


class BadInput(Exception):
    """The request body breaks a rule; the message says which."""


def validate(body: object) -> tuple[str, str, str]:
    """Return (name, tagline, domain) from a POST body, or raise BadInput."""
    if not isinstance(body, dict):
        raise BadInput("body must be a JSON object")
    values = []
    for field in ("name", "tagline", "domain"):
        if field not in body:
            raise BadInput(f"field {field!r} is required")
        value = body[field]
        if not isinstance(value, str):
            raise BadInput(f"field {field!r} must be a string")
        if not value.strip():
            raise BadInput(f"field {field!r} must not be empty")
        values.append(value.strip())
    name, tagline, domain = values
    if len(name) > MAX_NAME:
        raise BadInput(f"name must be at most {MAX_NAME} characters")
    domain = domain.lower()
    if not DNS_LABEL.match(domain):
        raise BadInput(
            "domain must be a valid DNS label: 1 to 63 letters, digits or hyphens,"
            " not starting or ending with a hyphen"
        )
    return name, tagline, domain


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def make_app(
    sites: Sites,
    service: tickler.Service[str, None],
    settings: Settings,
    log: StepLog | None = None,
) -> Starlette:
    """The ASGI app: POST/GET/DELETE /sites, GET /stats and GET /metrics."""
    if log is None:
        log = StepLog()
    registry = prometheus_client.CollectorRegistry()
    registry.register(tickler.prometheus.Collector(service))

    async def describe(status: dict[str, Any]) -> dict[str, Any]:
        """The status, with each step's attempts as tickler counts them, in any replica."""
        tickets = [await service.lookup(Step(status["id"], name).key) for name in STEPS]
        return {
            **status,
            "attempts": {
                name: ticket.attempts if ticket is not None else 0
                for name, ticket in zip(STEPS, tickets, strict=True)
            },
        }

    async def create_site(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "body must be a JSON object")
        try:
            name, tagline, domain = validate(body)
        except BadInput as exc:
            return error(400, str(exc))
        try:
            # The site and its first step, committed together.
            status = await sites.create(name, tagline, domain, max_pending=settings.max_pending)
        except DomainTaken:
            return error(409, f"domain {domain!r} is already taken")
        except TooManyPending:
            return error(
                503, "too many pending requests, retry later", {"Retry-After": RETRY_AFTER}
            )
        return JSONResponse(
            await describe(status), status_code=202, headers={"Location": f"/sites/{status['id']}"}
        )

    async def get_site(request: Request) -> Response:
        site_id = request.path_params["site_id"]
        status = await sites.get(site_id)
        if status is None:
            return error(404, f"no site with id {site_id}")
        return JSONResponse(await describe(status))

    async def delete_site(request: Request) -> Response:
        site_id = request.path_params["site_id"]
        # `deleting` and the delete step, committed together.
        status = await sites.mark_deleting(site_id)
        if status is None:
            return error(404, f"no site with id {site_id}")
        if status["state"] == "deleting":
            # Stop the creation steps now, in whichever replica runs them. The
            # delete step does the same before it removes anything, so this
            # wait may give up (a replica that died holds a step until its
            # lease expires).
            with trio.move_on_after(settings.abort_timeout):
                await abort_creation(service, site_id, log=log)
                log.write("aborted", site_id, "request")
        return JSONResponse(
            await describe(status), status_code=202, headers={"Location": f"/sites/{site_id}"}
        )

    async def stats(request: Request) -> Response:
        return JSONResponse(
            {
                "replica": attrs.asdict(service.statistics()),
                "store": await service.store_statistics(),
            }
        )

    async def metrics(request: Request) -> Response:
        # Off the Trio thread: the collector reads the store with an await in this run.
        body = await trio.to_thread.run_sync(prometheus_client.generate_latest, registry)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/sites", create_site, methods=["POST"]),
            Route("/sites/{site_id:int}", get_site, methods=["GET"]),
            Route("/sites/{site_id:int}", delete_site, methods=["DELETE"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


async def serve(
    settings: Settings,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the service until ``shutdown`` is set, then shut down gracefully.

    Reports the base URL it listens on through ``task_status``. On shutdown it
    stops taking HTTP requests, then drains tickler for at most
    ``settings.shutdown_timeout`` seconds; what does not finish stays in the
    store, and this replica or another runs it. Cancelling this task instead
    is a hard stop.
    """
    if shutdown is None:
        shutdown = trio.Event()
    database = await trio.to_thread.run_sync(
        lambda: open_database(
            settings.data,
            settings.postgres,
            settings.schema,
            lease=settings.lease,
            poll_interval=settings.poll_interval,
        )
    )
    log = StepLog(settings.step_log)
    try:
        sites = Sites(database)
        rng = random.Random(settings.seed)  # noqa: S311 - simulated failures, not secrets
        workflow = Workflow(
            sites, settings.data, Backend(settings.latency, settings.fail_rate, rng), log
        )
        # Backend and database failures are retried until they succeed (or
        # a stop's deadline ends them, and the store runs them again later).
        retry = tickler.Retry(
            attempts=None,
            initial=settings.retry_initial,
            maximum=settings.retry_maximum,
            on=(BackendError, tickler.QueueFull, *database.transient),
        )
        async with tickler.open_service(
            workflow,
            capacity=settings.capacity,
            max_queue_length=settings.max_queue_length,
            retry=retry,
            name=QUEUE,
            store=database.store,
            histograms=True,  # GET /metrics exports them
            shutdown_timeout=settings.shutdown_timeout,
        ) as service:
            config = hypercorn.config.Config()
            config.bind = [f"{settings.host}:{settings.port}"]
            config.graceful_timeout = min(settings.shutdown_timeout, 5.0)
            config.accesslog = None
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(
                    lambda task_status: hypercorn.trio.serve(
                        make_app(sites, service, settings, log),  # type: ignore[arg-type]  # Starlette and hypercorn type ASGI apart
                        config,
                        shutdown_trigger=shutdown.wait,
                        task_status=task_status,
                    )
                )
                task_status.started(binds[0])
    finally:
        log.close()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(database.close)
