"""tickler's PostgresStore next to pgqueuer and procrastinate, on one server, in one run.

    python -m bench --postgres-only    # these rows alone
    python -m bench --postgres-only --only drain    # the drain rows alone
    python -m bench --postgres-only --only tickler-drain    # tickler's two drains alone

Each system runs in processes of its own (bench/pg_worker.py, started with
``sys.executable``) against the same server, in the benchmark's own database
(``tickler_bench``, created if missing), each in a schema of its own
(tickler_bench, pgqueuer, procrastinate), dropped and installed again with
the system's own schema install before every measurement. Nothing touches
another database. The DSN comes from TICKLER_BENCH_POSTGRES; without a
server there, every row here is skipped and says why.

- **Drain**: ``drain`` no-op requests are inserted first, the server is
  ANALYZEd and CHECKPOINTed, then one worker process starts (concurrency
  100). The time runs from the server's clock just before the parent tells
  the worker to go, to the completion time each store records for the
  request that completed last: tickler's ``finished_at``, pgqueuer's log row
  ``created``, procrastinate's ``succeeded`` event ``at``, each the time of
  the transaction that made the request final. The parent polls the store
  every ``poll`` seconds until enough are final, so the poll does not bound
  the time. A baseline too slow to drain them all within the time this part
  may take is timed to its first ``counted`` completions, with the same
  number queued, and its row says so. tickler's drain runs a second time
  with the same requests spread over ``groups`` groups (written by
  ``enqueue_many_in(..., group=...)``, ``group_chunk`` requests a call, the
  groups taking turns) and its service given
  ``limits=tickler.Limit(concurrency=group_concurrency)``; its row is
  divided by the ungrouped drain of the same round.
- **Latency**: an idle worker runs; the parent enqueues one request at a
  time, stamped with ``time.time_ns()`` just before the enqueue call, by each
  system's way from another process (tickler: ``store.enqueue_in`` in a
  transaction on the parent's own connection, then COMMIT, which delivers
  its NOTIFY; pgqueuer: ``Queries.enqueue``, whose trigger NOTIFYs;
  procrastinate: ``defer_async``, likewise). The handler reports its start
  minus the stamp; ``gap`` seconds between requests let each find the
  worker idle. p50 and p99 are taken over every round's requests.
- **Enqueue**: requests a second through each system's enqueue calls, with
  no worker running (tickler's service holds its one slot, so its batches
  only write): ``submits`` concurrent calls (tickler ``submit``, each
  returning once its request is committed, which group-commits them;
  pgqueuer over an asyncpg pool of 10; procrastinate over its pool of 4),
  ``each`` calls one after another, each its own committed transaction, and
  ``batch`` requests in one transaction (tickler: one ``enqueue_many_in``,
  and, the old way, ``enqueue_in`` called ``batch`` times; the baselines:
  their one-statement batch calls). Each batch is repeated ``batch_repeats``
  times in its worker (tickler's two ways taking turns), and its row is the
  median of those.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote, urlencode

from ._table import Row

DSN_ENV = "TICKLER_BENCH_POSTGRES"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DATABASE = "tickler_bench"
SCHEMAS = {"tickler": "tickler_bench", "pgqueuer": "pgqueuer", "procrastinate": "procrastinate"}
WORKER = Path(__file__).with_name("pg_worker.py")
QUEUE = "bench"
# How each system's row keys end.
SUFFIXES = {"tickler": "", "pgqueuer": "_pgq", "procrastinate": "_proc"}
T = TypeVar("T")


@dataclass
class PgConfig:
    drain: int = 100_000
    concurrency: int = 100
    # The baselines too slow to drain all of it within the few minutes this
    # part may take are timed to their first `counted` completions, with the
    # same `drain` requests queued.
    counted: int = 5_000  # procrastinate
    counted_default: int = 20_000  # pgqueuer at its default batch size
    # The grouped drain: the same requests spread over `groups` groups, each
    # limited to `group_concurrency` in flight; written `group_chunk` a call
    # (enqueue_many_in), the groups taking turns.
    groups: int = 100
    group_concurrency: int = 1
    group_chunk: int = 10
    # Latency: `latency` requests per block, `blocks` blocks per system, the
    # systems taking turns block by block, so that a slow spell of the
    # machine falls on each of them alike.
    latency: int = 100
    blocks: int = 5
    gap: float = 0.05
    settle: float = 1.0
    submits: int = 2_000
    each: int = 500
    batch: int = 5_000
    batch_repeats: int = 5
    rounds: int = 1
    poll: float = 0.5
    timeout: float = 600.0
    # "drain": the drain rows alone (no latency, no enqueue); "tickler-drain": tickler's
    # ungrouped and grouped drains alone.
    only: str = ""
    skipped: str = ""  # set by run(): why rows have no samples
    machine: str = ""  # set by run(): the server and the libraries measured
    failures: list[str] = field(default_factory=list)  # set by run(): what failed, and why


QUICK = PgConfig(
    drain=500,
    counted=100,
    counted_default=200,
    latency=10,
    blocks=2,
    gap=0.02,
    settle=0.5,
    submits=100,
    each=20,
    batch=200,
    batch_repeats=2,
    poll=0.1,
    timeout=60.0,
)


# -- the server ---------------------------------------------------------------------


def with_database(dsn: str, dbname: str) -> str:
    """The DSN as a URL (asyncpg reads only URLs) naming another database."""
    import psycopg.conninfo

    params: dict[str, Any] = {
        k: str(v) for k, v in psycopg.conninfo.conninfo_to_dict(dsn).items() if v is not None
    }
    params.pop("dbname", None)
    user = quote(params.pop("user", ""), safe="")
    password = params.pop("password", None)
    host = params.pop("host", "")
    port = params.pop("port", "")
    if host.startswith("/"):  # a socket directory goes in the query
        params["host"], host = host, ""
    credentials = f"{user}:{quote(password, safe='')}" if password is not None else user
    netloc = (f"{credentials}@" if credentials else "") + host + (f":{port}" if port else "")
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{netloc}/{quote(dbname, safe='')}{query}"


def open_database(dsn: str) -> str:
    """The benchmark database's DSN, created if missing; raises if the server cannot be reached."""
    import psycopg
    import psycopg.sql

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as db:
        found = db.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
        if found is None:
            create = psycopg.sql.SQL("CREATE DATABASE {}")
            db.execute(create.format(psycopg.sql.Identifier(DATABASE)))
    return with_database(dsn, DATABASE)


def reset_schema(dsn: str, system: str) -> None:
    """Drop the system's schema; create it empty for the baselines (tickler creates its own)."""
    import psycopg

    schema = SCHEMAS[system]
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        if system != "tickler":
            db.execute(f'CREATE SCHEMA "{schema}"')


def drop_schemas(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as db:
        for schema in SCHEMAS.values():
            db.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def server_version(dsn: str) -> str:
    import psycopg

    with psycopg.connect(dsn) as db:
        row = db.execute("SHOW server_version").fetchone()
    return str(row[0]).split()[0] if row else "?"


# -- worker processes ---------------------------------------------------------------


class Worker:
    """A pg_worker.py process: JSON lines out, commands in."""

    def __init__(self, system: str, mode: str, config: dict[str, Any]) -> None:
        self.system = system
        self.stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(  # noqa: S603 - our own script, our own interpreter
            [sys.executable, str(WORKER), system, mode, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self.stderr.seek(0)
            raise RuntimeError(
                f"the {self.system} worker ended (exit {self.process.returncode}):\n"
                + self.stderr.read()[-3000:]
            )
        message: dict[str, Any] = json.loads(line)
        return message

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def close(self, timeout: float = 60.0) -> None:
        """Ask the worker to stop, and wait for it (kill it past the timeout)."""
        try:
            if self.process.poll() is None:
                self.send("stop")
                assert self.process.stdin is not None
                self.process.stdin.close()
            self.process.wait(timeout)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            self.stderr.close()


def worker_config(dsn: str, system: str, config: PgConfig, **extra: object) -> dict[str, Any]:
    return {
        "dsn": dsn,
        "schema": SCHEMAS[system],
        "concurrency": config.concurrency,
        # pgqueuer's largest batch at this concurrency (it refuses
        # max_concurrent_tasks < 2 * batch_size): its fastest drain here.
        "batch_size": config.concurrency // 2,
        "settle": config.settle,
        **extra,
    }


# -- drain --------------------------------------------------------------------------

# The completions a store has recorded, and the time of the k-th (epoch seconds).
_COMPLETIONS = {
    "tickler": (
        "SELECT count(*) FROM {s}.tickler_requests WHERE state = 'succeeded'",
        "SELECT finished_at FROM {s}.tickler_requests WHERE state = 'succeeded'"
        " ORDER BY finished_at OFFSET %s LIMIT 1",
    ),
    "pgqueuer": (
        "SELECT count(*) FROM {s}.pgqueuer_log WHERE status = 'successful'",
        "SELECT extract(epoch FROM created)::float8 FROM {s}.pgqueuer_log"
        " WHERE status = 'successful' ORDER BY created OFFSET %s LIMIT 1",
    ),
    "procrastinate": (
        "SELECT count(*) FROM {s}.procrastinate_events WHERE type = 'succeeded'",
        "SELECT extract(epoch FROM at)::float8 FROM {s}.procrastinate_events"
        " WHERE type = 'succeeded' ORDER BY at OFFSET %s LIMIT 1",
    ),
}


def drain(dsn: str, system: str, config: PgConfig, counted: int, **options: object) -> float:
    """Requests a second: ``counted`` completions out of ``config.drain`` inserted first."""
    import psycopg

    reset_schema(dsn, system)
    worker = Worker(system, "drain", worker_config(dsn, system, config, n=config.drain, **options))
    try:
        assert worker.read().get("ready")
        count_sql, kth_sql = (sql.format(s=SCHEMAS[system]) for sql in _COMPLETIONS[system])
        with psycopg.connect(dsn, autocommit=True) as db:
            db.execute("ANALYZE")
            db.execute("CHECKPOINT")
            row = db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
            assert row is not None
            start = float(row[0])
            worker.send("go")
            deadline = time.monotonic() + config.timeout
            while True:
                row = db.execute(count_sql).fetchone()
                if row is not None and row[0] >= counted:
                    break
                if worker.process.poll() is not None:
                    worker.read()  # raises with the worker's stderr
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{system}: fewer than {counted:,} completions in time")
                time.sleep(config.poll)
            row = db.execute(kth_sql, (counted - 1,)).fetchone()
            assert row is not None
            return counted / (float(row[0]) - start)
    finally:
        worker.close()


# -- latency ------------------------------------------------------------------------


def latency(dsn: str, enqueuer: str, config: PgConfig) -> list[float]:
    """Milliseconds from the stamp before each enqueue call to its handler's start.

    ``enqueuer`` is a system, or ``tickler_tx``: tickler's worker, enqueued to
    in a transaction of the caller's instead of by one autocommitted
    statement.
    """
    system = "tickler" if enqueuer == "tickler_tx" else enqueuer
    reset_schema(dsn, system)
    worker = Worker(system, "latency", worker_config(dsn, system, config))
    try:
        assert worker.read().get("ready")
        if system == "tickler":
            return _latency_tickler(dsn, worker, config, enqueuer == "tickler_tx")
        return asyncio.run(_latency_asyncio(dsn, system, worker, config))
    finally:
        worker.close()


def _latency_tickler(
    dsn: str, worker: Worker, config: PgConfig, in_transaction: bool
) -> list[float]:
    """enqueue_in alone on an autocommit connection (as pgqueuer's enqueue), or in BEGIN/COMMIT."""
    import psycopg

    import tickler

    store = tickler.PostgresStore(dsn, schema=SCHEMAS["tickler"])
    samples: list[float] = []
    with psycopg.connect(dsn, autocommit=not in_transaction) as db:
        for _ in range(config.latency):
            time.sleep(config.gap)
            stamp = time.time_ns()
            if in_transaction:
                with db.transaction():  # COMMIT ends the block: the NOTIFY goes out then
                    store.enqueue_in(db, QUEUE, stamp)
            else:
                store.enqueue_in(db, QUEUE, stamp)  # commits, and notifies, at once
            samples.append(worker.read()["latency_ns"] / 1e6)
    return samples


async def _latency_asyncio(dsn: str, system: str, worker: Worker, config: PgConfig) -> list[float]:
    loop = asyncio.get_running_loop()
    samples: list[float] = []
    enqueue: Callable[[int], Any]
    if system == "pgqueuer":
        import asyncpg
        from pgqueuer import AsyncpgDriver, Queries

        connection = await asyncpg.connect(dsn, server_settings={"search_path": SCHEMAS[system]})
        queries = Queries(AsyncpgDriver(connection))

        def enqueue(stamp: int) -> Any:
            return queries.enqueue(QUEUE, str(stamp).encode())

        close: Callable[[], Any] = connection.close
    else:
        from . import pg_worker

        app = pg_worker.procrastinate_app({"dsn": dsn, "schema": SCHEMAS[system]}, "enqueue")
        await app.open_async()
        task = app.tasks["noop"]

        def enqueue(stamp: int) -> Any:
            return task.defer_async(stamp=stamp)

        close = app.close_async
    try:
        for _ in range(config.latency):
            await asyncio.sleep(config.gap)
            await enqueue(time.time_ns())
            message = await loop.run_in_executor(None, worker.read)
            samples.append(message["latency_ns"] / 1e6)
    finally:
        await close()
    return samples


# -- enqueue ------------------------------------------------------------------------


def enqueue_rates(dsn: str, system: str, config: PgConfig) -> dict[str, float | list[float]]:
    """Each kind's rate, or for the batches a list of rates: one a repeat."""
    reset_schema(dsn, system)
    worker = Worker(
        system,
        "enqueue",
        worker_config(
            dsn,
            system,
            config,
            submits=config.submits,
            each=config.each,
            batch=config.batch,
            repeats=config.batch_repeats,
        ),
    )
    try:
        rates: dict[str, float | list[float]] = worker.read()["rates"]
        return rates
    finally:
        worker.close()


# -- rows ---------------------------------------------------------------------------


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def rows(config: PgConfig) -> list[Row]:
    n, c = f"{config.drain:,}", config.concurrency
    pgq = f"pgqueuer, max_concurrent_tasks={c}, batch_size={c // 2}"
    proc = f"procrastinate, concurrency={c}"
    return [
        Row(
            "pg_tickler",
            "pg drain",
            f"tickler PostgresStore, capacity={c}",
            [],
            "req/s",
            "pg_pgq",
            ("ratio", ">=", 2.0),
        ),
        Row(
            "pg_tickler_proc",
            "pg drain",
            f"tickler PostgresStore, capacity={c}",
            [],
            "req/s",
            "pg_proc",
            ("ratio", ">=", 5.0),
        ),
        Row(
            "pg_groups",
            "pg drain",
            f"tickler PostgresStore, capacity={c}, {config.groups:,} groups,"
            f" Limit(concurrency={config.group_concurrency})",
            [],
            "req/s",
            "pg_tickler",
            ("ratio", ">=", 0.5),
        ),
        Row("pg_pgq", "pg drain", pgq, [], "req/s"),
        Row(
            "pg_pgq_default",
            "pg drain",
            f"pgqueuer, max_concurrent_tasks={c}, batch_size=10 (its default),"
            f" first {config.counted_default:,} of {n}",
            [],
            "req/s",
            "pg_pgq",
        ),
        Row(
            "pg_proc",
            "pg drain",
            f"{proc}, first {config.counted:,} of {n}",
            [],
            "req/s",
            "pg_pgq",
        ),
        *(
            Row(
                f"pg_{p}_{system}",
                f"pg latency {p}",
                variant,
                [],
                "ms",
                None if system == "pgq" else f"pg_{p}_pgq",
                ("ratio", "<=", 1.0) if system == "tickler" else None,
            )
            for p in ("p50", "p99")
            for system, variant in (
                ("tickler", "tickler, enqueue_in (autocommit) in another process"),
                ("tickler_tx", "tickler, BEGIN + enqueue_in + COMMIT in another process"),
                ("pgq", "pgqueuer, Queries.enqueue (autocommit) in another process"),
                ("proc", "procrastinate, defer_async in another process"),
            )
        ),
        Row(
            "pg_submit",
            "pg enqueue",
            f"tickler submit, {config.submits:,} in parallel, to their commits",
            [],
            "req/s",
            "pg_submit_pgq",
        ),
        Row(
            "pg_submit_pgq",
            "pg enqueue",
            f"pgqueuer enqueue, {config.submits:,} concurrent calls, asyncpg pool of 10",
            [],
            "req/s",
        ),
        Row(
            "pg_submit_proc",
            "pg enqueue",
            f"procrastinate defer_async, {config.submits:,} concurrent calls, pool of 4",
            [],
            "req/s",
            "pg_submit_pgq",
        ),
        Row(
            "pg_each",
            "pg enqueue",
            "tickler enqueue_in, one per caller transaction (BEGIN, enqueue_in, COMMIT)",
            [],
            "req/s",
            "pg_each_pgq",
        ),
        Row(
            "pg_each_pgq",
            "pg enqueue",
            "pgqueuer enqueue, one job per call (autocommit)",
            [],
            "req/s",
        ),
        Row(
            "pg_each_proc",
            "pg enqueue",
            "procrastinate defer_async, one job per call",
            [],
            "req/s",
            "pg_each_pgq",
        ),
        Row(
            "pg_many",
            "pg enqueue",
            f"tickler enqueue_many_in, {config.batch:,} requests in one caller transaction",
            [],
            "req/s",
            "pg_batch_pgq",
            ("ratio", ">=", 1.0),
        ),
        Row(
            "pg_batch",
            "pg enqueue",
            f"tickler enqueue_in, {config.batch:,} calls in one caller transaction",
            [],
            "req/s",
            "pg_batch_pgq",
        ),
        Row(
            "pg_batch_pgq",
            "pg enqueue",
            f"pgqueuer enqueue, {config.batch:,} jobs in one call",
            [],
            "req/s",
        ),
        Row(
            "pg_batch_proc",
            "pg enqueue",
            f"procrastinate batch_defer_async, {config.batch:,} jobs in one call",
            [],
            "req/s",
            "pg_batch_pgq",
        ),
    ]


def _percentile(samples: list[float], p: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[p - 1]


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:400]


def run(config: PgConfig, out: Callable[[str], object] = print) -> list[Row]:
    """Every PostgreSQL row, measured; without samples (and config.skipped set) if it cannot be."""
    table = {row.key: row for row in rows(config)}
    dsn = os.environ.get(DSN_ENV, DEFAULT_DSN)
    if not _installed("psycopg"):
        config.skipped = "psycopg not installed: pip install -e '.[bench]'"
        out(f"  postgres: skipped: {config.skipped}")
        return list(table.values())
    try:
        bench_dsn = open_database(dsn)
    except Exception as exc:
        config.skipped = f"no PostgreSQL at {dsn} ({_one_line(exc)})"
        out(f"  postgres: skipped: {config.skipped}")
        return list(table.values())
    missing = [name for name in ("pgqueuer", "procrastinate", "asyncpg") if not _installed(name)]
    if missing:
        config.skipped = (
            f"{', '.join(missing)} not installed: pip install -e '.[bench]' (the tickler rows ran)"
        )
    systems = ["tickler"] if missing else ["tickler", "pgqueuer", "procrastinate"]

    def attempt(label: str, fn: Callable[[], T]) -> T | None:
        """fn(); a failure is reported and returns None, and the run goes on."""
        out(f"{step} {label}")
        try:
            return fn()
        except Exception as exc:
            config.failures.append(f"{label}: {_one_line(exc)}")
            out(f"  postgres: {label} FAILED: {_one_line(exc)}")
            return None

    def sample(keys: tuple[str, ...], value: float | None) -> None:
        if value is not None:
            for key in keys:
                table[key].samples.append(value)

    enqueuers = ["tickler", "tickler_tx", *systems[1:]]
    latencies: dict[str, list[float]] = {enqueuer: [] for enqueuer in enqueuers}
    for round_no in range(config.rounds):
        step = f"  round {round_no + 1}/{config.rounds}: postgres"
        rate = attempt("drain, tickler", partial(drain, bench_dsn, "tickler", config, config.drain))
        sample(("pg_tickler", "pg_tickler_proc"), rate)
        rate = attempt(
            "drain, tickler, grouped and limited",
            partial(
                drain,
                bench_dsn,
                "tickler",
                config,
                config.drain,
                groups=config.groups,
                group_chunk=config.group_chunk,
                group_concurrency=config.group_concurrency,
            ),
        )
        sample(("pg_groups",), rate)
        if len(systems) > 1 and config.only != "tickler-drain":
            rate = attempt(
                "drain, pgqueuer", partial(drain, bench_dsn, "pgqueuer", config, config.drain)
            )
            sample(("pg_pgq",), rate)
            rate = attempt(
                "drain, pgqueuer at its default batch size",
                partial(
                    drain, bench_dsn, "pgqueuer", config, config.counted_default, batch_size=10
                ),
            )
            sample(("pg_pgq_default",), rate)
            rate = attempt(
                "drain, procrastinate",
                partial(drain, bench_dsn, "procrastinate", config, config.counted),
            )
            sample(("pg_proc",), rate)
        if config.only:
            continue
        for block in range(config.blocks):
            turn = enqueuers[block % len(enqueuers) :] + enqueuers[: block % len(enqueuers)]
            for enqueuer in turn:
                found = attempt(
                    f"latency, {enqueuer}, block {block + 1}/{config.blocks}",
                    partial(latency, bench_dsn, enqueuer, config),
                )
                latencies[enqueuer] += found or []
        for system in systems:
            rates = attempt(f"enqueue, {system}", partial(enqueue_rates, bench_dsn, system, config))
            for kind, value in (rates or {}).items():
                for one in value if isinstance(value, list) else [value]:
                    sample((f"pg_{kind}{SUFFIXES[system]}",), one)
    for enqueuer, samples in latencies.items():
        name = "_tickler_tx" if enqueuer == "tickler_tx" else SUFFIXES[enqueuer] or "_tickler"
        if len(samples) >= 2:
            sample((f"pg_p50{name}",), statistics.median(samples))
            sample((f"pg_p99{name}",), _percentile(samples, 99))
    drop_schemas(bench_dsn)
    config.machine = (
        f"PostgreSQL {server_version(bench_dsn)} at {dsn}, psycopg {_installed('psycopg')}"
        + "".join(
            f", {name} {_installed(name)}"
            for name in ("pgqueuer", "asyncpg", "uvloop", "procrastinate")
            if _installed(name)
        )
    )
    return list(table.values())


def notes(config: PgConfig) -> list[str]:
    """The lines render() prints under the table about the PostgreSQL rows."""
    if config.skipped and not config.machine:
        return [f"PostgreSQL rows skipped: {config.skipped}."]
    lines = [
        f"PostgreSQL: drain {config.drain:,} no-op requests inserted first, concurrency"
        f" {config.concurrency}, from the go to the last completion each store records"
        f" (tickler's grouped drain: the same requests in {config.groups:,} groups, written"
        f" {config.group_chunk:,} a call by enqueue_many_in(group=...), the groups taking"
        f" turns, each group at most {config.group_concurrency} in flight);"
        f" latency over {config.latency * config.blocks * config.rounds:,} requests per system,"
        f" one at a time on an idle worker, in blocks of {config.latency} that take turns"
        f" between the systems; medians of {config.rounds}"
        f" round{'s' if config.rounds != 1 else ''}; each {config.batch:,}-request batch"
        f" (COMMIT included) is the median of {config.batch_repeats * config.rounds} repeats."
        f" {config.machine}.",
    ]
    if config.skipped:
        lines.append(f"PostgreSQL baselines skipped: {config.skipped}.")
    if config.only:
        lines.append(f"Run with --only {config.only}: the other PostgreSQL rows did not run.")
    lines += [f"PostgreSQL measurement failed: {failure}." for failure in config.failures]
    return lines
