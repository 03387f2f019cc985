"""Two git revisions side by side: the burst, enqueue and PostgreSQL drain rows, alternating.

    python -m bench.compare REV_A REV_B [--rows burst,enqueue,pg-drain] [--rounds K]

Each revision is checked out in a detached worktree of its own (in a
temporary directory, removed at the end), and each measurement runs in a
fresh subprocess with ``PYTHONPATH`` set to that tree, so that it runs that
revision's tickler through that revision's own ``bench`` functions. The
rounds alternate: A, then B, for each row, K times. Each revision runs in
its default configuration (the histograms on where the revision has them on
by default). The figures printed are medians over the rounds, and B/A.

Rows:

- ``burst``: ``burst_tickler(n, 100)``, and in the same subprocess the Trio
  worker pool (``burst_pool``): each revision's req/s and its ratio to the
  pool (the median of the per-round ratios);
- ``enqueue``: ``enqueue_cost(n)`` (ns per ``enqueue_request``), and in the
  same subprocess ``bare_append(n)``: each revision's ns/call and its ratio
  to the bare locked append;
- ``pg-drain``: ``bench.postgres.drain(dsn, "tickler", PgConfig(), n)``
  (req/s), on the server that ``--dsn`` (or ``TICKLER_BENCH_POSTGRES``) names.

With ``--lock PATH`` (or ``TICKLER_BENCH_LOCK``), each measurement runs
under ``flock PATH``, so that measurements of several people on one machine
take turns; without it, nothing is locked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROWS = ("burst", "enqueue", "pg-drain")
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"

# Runs in the subprocess, in the revision's tree: one measurement, printed as JSON.
# It adapts to the revision's bench: the service's own histograms default is
# passed to burst_tickler where that takes one.
_DRIVER = r"""
import inspect, json, sys
import trio
import tickler
from bench import run as bench_run

row, n = sys.argv[1], int(sys.argv[2])
out = {}
if row == "burst":
    default = inspect.signature(tickler.Service).parameters.get("histograms")
    takes = inspect.signature(bench_run.burst_tickler).parameters
    kwargs = {}
    if default is not None and "histograms" in takes:
        kwargs["histograms"] = default.default
        out["histograms"] = default.default

    async def tickler_burst():
        return await bench_run.burst_tickler(n, 100, **kwargs)

    # A warm-up of each, not timed, then the pool and tickler.
    bench_run.in_context(False, trio.run, bench_run.burst_pool, min(n, 10_000), 100)
    bench_run.in_context(False, trio.run, bench_run.burst_tickler, min(n, 10_000), 100)
    pool = bench_run.in_context(False, trio.run, bench_run.burst_pool, n, 100)
    elapsed = bench_run.in_context(False, trio.run, tickler_burst)[0]
    out.update(value=n / elapsed, baseline=n / pool)
elif row == "enqueue":
    bench_run.in_context(False, trio.run, bench_run.enqueue_cost, min(n, 10_000))
    bare = bench_run.bare_append(n)
    cost = bench_run.in_context(False, trio.run, bench_run.enqueue_cost, n)
    out.update(value=cost, baseline=bare)
elif row == "pg-drain":
    from bench import postgres

    dsn = postgres.open_database(sys.argv[3])
    config = postgres.PgConfig()
    config.drain = n
    out.update(value=postgres.drain(dsn, "tickler", config, n))
print(json.dumps(out))
"""


@dataclass
class Row:
    name: str
    unit: str
    baseline: str  # what each revision's own baseline measurement is
    higher_is_better: bool
    values: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)  # value / baseline


def _rows() -> dict[str, Row]:
    return {
        "burst": Row("burst", "req/s", "the Trio pool", True),
        "enqueue": Row("enqueue", "ns/call", "a bare locked append", False),
        "pg-drain": Row("pg-drain", "req/s", "", True),
    }


def _git(*args: str, cwd: Path) -> str:
    done = subprocess.run(  # noqa: S603 - git, with our own arguments
        ["git", *args],  # noqa: S607 - the git on PATH, as a developer runs it
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def _metadata(directory: Path) -> Path:
    """A directory that holds the metadata of a distribution named ``tickler``.

    An older tickler read its version from that name, which the environment
    may not have (it is ``trio-tickler`` now): with this directory on the
    path, it imports (and so do its worker subprocesses).
    """
    info = directory / "metadata" / "tickler-0+compare.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tickler\nVersion: 0+compare\n")
    return info.parent


def measure(
    tree: Path,
    row: str,
    n: int,
    dsn: str,
    lock: str | None,
    metadata: Path,
    python: str = sys.executable,
) -> dict[str, float]:
    """One measurement of ``row`` by the revision checked out in ``tree``."""
    command = [python, "-c", _DRIVER, row, str(n), dsn]
    if lock:
        command = ["flock", lock, *command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tree), str(metadata)))}
    done = subprocess.run(  # noqa: S603 - our own interpreter and driver
        command, cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{row} in {tree} failed (exit {done.returncode}):\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare(
    repo: Path,
    revisions: Sequence[str],
    rows: Sequence[str],
    rounds: int,
    sizes: dict[str, int],
    dsn: str,
    lock: str | None,
    out: Callable[[str], object] | None = None,
) -> dict[str, Row]:
    """Measure ``rows`` for both revisions (A and B), alternating, and return them."""
    table = {name: row for name, row in _rows().items() if name in rows}
    with tempfile.TemporaryDirectory(prefix="tickler-compare-") as directory:
        trees: list[Path] = []
        metadata = _metadata(Path(directory))
        if out is not None:
            out(f"worktrees in {directory}")
        try:
            for label, revision in zip("AB", revisions, strict=True):
                commit = _git("rev-parse", "--verify", f"{revision}^{{commit}}", cwd=repo)
                tree = Path(directory) / f"{label}-{commit[:12]}"
                _git("worktree", "add", "--detach", str(tree), commit, cwd=repo)
                trees.append(tree)
            for round_no in range(rounds):
                for name, row in table.items():
                    for label, tree in zip("AB", trees, strict=True):
                        got = measure(tree, name, sizes[name], dsn, lock, metadata)
                        row.values.setdefault(label, []).append(got["value"])
                        if "baseline" in got:
                            ratio = got["value"] / got["baseline"]
                            row.ratios.setdefault(label, []).append(ratio)
                        if out is not None:
                            out(
                                f"round {round_no + 1}/{rounds} {name} {label}:"
                                f" {got['value']:,.1f} {row.unit}"
                            )
        finally:
            for tree in trees:
                _git("worktree", "remove", "--force", str(tree), cwd=repo)
            shutil.rmtree(directory, ignore_errors=True)
    return table


def render(table: dict[str, Row], revisions: Sequence[str]) -> str:
    a, b = revisions
    lines = [
        f"A = {a}, B = {b}",
        "",
        "| row | A | B | B/A | A over its baseline | B over its baseline |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in table.values():
        ma, mb = (statistics.median(row.values[label]) for label in "AB")
        own = [
            f"{statistics.median(row.ratios[label]):.2f}x {row.baseline}"
            f" ({min(row.ratios[label]):.2f}x to {max(row.ratios[label]):.2f}x)"
            if label in row.ratios
            else ""
            for label in "AB"
        ]
        better = "higher is better" if row.higher_is_better else "lower is better"
        lines.append(
            f"| {row.name} ({row.unit}, {better}) | {ma:,.1f} | {mb:,.1f} | {mb / ma:.3f}x"
            f" | {own[0]} | {own[1]} |"
        )
    rounds = min(len(v) for row in table.values() for v in row.values.values())
    lines.append("")
    lines.append(
        f"Medians of {rounds} rounds, the two revisions alternating in each; in brackets,"
        " the lowest and highest of a revision's rounds."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare", description=__doc__.splitlines()[0]
    )
    parser.add_argument("a", metavar="REV_A", help="the revision compared against (A)")
    parser.add_argument("b", metavar="REV_B", help="the revision measured (B)")
    parser.add_argument("--rows", default="burst,enqueue,pg-drain", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--burst", type=int, default=100_000, help="requests in the burst")
    parser.add_argument("--enqueue", type=int, default=100_000, help="enqueue_request calls")
    parser.add_argument("--drain", type=int, default=100_000, help="requests drained")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("TICKLER_BENCH_POSTGRES", DEFAULT_DSN),
        help="pg-drain's server (default: TICKLER_BENCH_POSTGRES, else 127.0.0.1:5432)",
    )
    parser.add_argument(
        "--lock",
        default=os.environ.get("TICKLER_BENCH_LOCK") or None,
        help="run each measurement under `flock LOCK` (default TICKLER_BENCH_LOCK; none)",
    )
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        parser.error(f"--rows takes some of {', '.join(ROWS)}, not {args.rows!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    sizes = {"burst": args.burst, "enqueue": args.enqueue, "pg-drain": args.drain}
    if min(sizes.values()) < 1:
        parser.error("--burst, --enqueue and --drain must be at least 1")
    if args.lock and shutil.which("flock") is None:
        parser.error("--lock needs the flock command (util-linux)")
    repo = Path(_git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
    revisions = (args.a, args.b)
    table = compare(
        repo,
        revisions,
        rows,
        args.rounds,
        sizes,
        args.dsn,
        args.lock,
        out=lambda line: print(line, file=sys.stderr),
    )
    print(render(table, revisions))


if __name__ == "__main__":
    main()
