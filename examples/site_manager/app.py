"""The HTTP API (Starlette, served by Hypercorn's Trio worker) and the server's life cycle."""

from __future__ import annotations

import random
import re
from pathlib import Path

import attrs
import hypercorn.config
import hypercorn.trio
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import tickler

from .store import DomainTaken, Store
from .workflow import Backend, BackendError, Step, Workflow, enqueue_steps, next_steps

MAX_NAME = 100
DNS_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
RETRY_AFTER = "1"


@attrs.frozen
class Settings:
    """How the service runs. The defaults suit a demo; tests shrink the delays."""

    data: Path
    host: str = "127.0.0.1"
    port: int = 8000
    fail_rate: float = 0.0
    latency: float = 0.05
    capacity: int = 16
    max_queue_length: int = 1000
    retry_initial: float = 0.05
    retry_maximum: float = 2.0
    shutdown_timeout: float = 5.0
    seed: int | None = None


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


def make_app(store: Store, service: tickler.Service[Step, None]) -> Starlette:
    """The ASGI app: POST/GET/DELETE /sites and GET /stats."""

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
            status = await store.create(name, tagline, domain)
        except DomainTaken:
            return error(409, f"domain {domain!r} is already taken")
        try:
            enqueue_steps(service, [Step("metadata", status["id"])])
        except (tickler.QueueFull, tickler.ServiceClosed):
            await store.forget(status["id"])
            return error(
                503, "too many pending requests, retry later", {"Retry-After": RETRY_AFTER}
            )
        return JSONResponse(status, status_code=202, headers={"Location": f"/sites/{status['id']}"})

    async def get_site(request: Request) -> Response:
        site_id = request.path_params["site_id"]
        status = await store.get(site_id)
        if status is None:
            return error(404, f"no site with id {site_id}")
        return JSONResponse(status)

    async def delete_site(request: Request) -> Response:
        site_id = request.path_params["site_id"]
        status = await store.mark_deleting(site_id)
        if status is None:
            return error(404, f"no site with id {site_id}")
        if status["state"] == "deleting":
            try:
                enqueue_steps(service, [Step("delete", site_id)])
            except (tickler.QueueFull, tickler.ServiceClosed):
                # The site stays `deleting`; restart recovery or a repeated
                # DELETE enqueues its delete again.
                return error(
                    503, "too many pending requests, retry later", {"Retry-After": RETRY_AFTER}
                )
        return JSONResponse(status, status_code=202, headers={"Location": f"/sites/{site_id}"})

    async def stats(request: Request) -> Response:
        return JSONResponse(attrs.asdict(service.statistics()))

    return Starlette(
        routes=[
            Route("/sites", create_site, methods=["POST"]),
            Route("/sites/{site_id:int}", get_site, methods=["GET"]),
            Route("/sites/{site_id:int}", delete_site, methods=["DELETE"]),
            Route("/stats", stats, methods=["GET"]),
        ]
    )


async def recover(store: Store, service: tickler.Service[Step, None]) -> int:
    """Enqueue the next steps of every site left `creating` or `deleting`."""
    pending = [step for status in await store.unfinished() for step in next_steps(status)]
    for step in pending:
        await service.submit(step, key=step)  # waits for room like any caller
    return len(pending)


async def serve(
    settings: Settings,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the service until ``shutdown`` is set, then shut down gracefully.

    Reports the base URL it listens on through ``task_status``. On shutdown it
    stops taking HTTP requests, then drains tickler for at most
    ``settings.shutdown_timeout`` seconds; what does not finish stays
    `creating` or `deleting` in the store and is picked up by recovery on the
    next start. Cancelling this task instead is a hard stop.
    """
    if shutdown is None:
        shutdown = trio.Event()
    settings.data.mkdir(parents=True, exist_ok=True)
    store = Store(settings.data / "status.sqlite3")
    try:
        rng = random.Random(settings.seed)  # noqa: S311 - simulated failures, not secrets
        workflow = Workflow(
            store, settings.data, Backend(settings.latency, settings.fail_rate, rng)
        )
        # Backend failures are retried until they succeed (or a stop's
        # deadline ends them); the restart picks up what a stop cut short.
        retry = tickler.Retry(
            attempts=None,
            initial=settings.retry_initial,
            maximum=settings.retry_maximum,
            on=(BackendError, tickler.QueueFull),
        )
        async with tickler.open_service(
            workflow,
            capacity=settings.capacity,
            max_queue_length=settings.max_queue_length,
            retry=retry,
            name="site_manager",
            shutdown_timeout=settings.shutdown_timeout,
        ) as service:
            await recover(store, service)
            config = hypercorn.config.Config()
            config.bind = [f"{settings.host}:{settings.port}"]
            config.graceful_timeout = min(settings.shutdown_timeout, 5.0)
            config.accesslog = None
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(
                    lambda task_status: hypercorn.trio.serve(
                        make_app(store, service),  # type: ignore[arg-type]  # Starlette and hypercorn type ASGI apart
                        config,
                        shutdown_trigger=shutdown.wait,
                        task_status=task_status,
                    )
                )
                task_status.started(binds[0])
    finally:
        store.close()
