"""Watch the tickler pattern's log dance.

Requests arrive at random 0-100 ms intervals and each takes 0-500 ms; then a
burst arrives with no delay, the queue grows, and the limit is reached. The
supervisor loop's DEBUG lines show each enqueue, dequeue and replenishment.
Request N of the demo is tickler's request #N, so its lines and the demo's agree.
The demo ends with the final statistics and one line that sums them up.

    python demo.py [--capacity 3] [--requests 40] [--burst 20] [--seed 1]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys

import attrs
import trio

import tickler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=3, help="slots (default 3)")
    parser.add_argument("--requests", type=int, default=40, help="spaced requests (default 40)")
    parser.add_argument("--burst", type=int, default=20, help="burst requests (default 20)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    return parser.parse_args(argv)


@attrs.frozen
class Outcome:
    """What a run of the demo showed."""

    statistics: tickler.ServiceStatistics
    """The service's final statistics."""
    most_at_once: int
    """The most handler runs at once, as the handler itself counted them."""


def _numbers(first: int, count: int) -> str:
    if count <= 0:
        return "no requests"
    if count == 1:
        return f"1 request (request-{first})"
    return f"{count} requests (request-{first} to request-{first + count - 1})"


async def main(capacity: int, requests: int, burst: int, seed: int) -> Outcome:
    """Run the demo and return what it showed."""
    rng = random.Random(seed)  # noqa: S311 - simulated arrival times, not secrets
    log = logging.getLogger("demo")
    running = most_at_once = 0

    async def handle(number: int) -> int:
        nonlocal running, most_at_once
        running += 1
        most_at_once = max(most_at_once, running)
        try:
            await trio.sleep(rng.uniform(0.0, 0.5))
        finally:
            running -= 1
        log.info("request-%d done%s", number, " (burst)" if number > requests else "")
        return number

    # The wait and run times printed at the end are recorded by default.
    async with tickler.open_service(handle, capacity=capacity, name="demo") as service:

        def enqueue(number: int) -> None:
            ticket = service.enqueue_request(number)
            # tickler numbers a service's requests 1, 2, 3...: request-N is "request #N".
            assert ticket.id == number, (ticket.id, number)

        log.info("phase 1: %s at random 0-100 ms intervals", _numbers(1, requests))
        for number in range(1, requests + 1):
            enqueue(number)
            await trio.sleep(rng.uniform(0.0, 0.1))
        log.info("phase 2: a burst of %s with no delay", _numbers(requests + 1, burst))
        for number in range(requests + 1, requests + burst + 1):
            enqueue(number)
        log.info("draining")
    return Outcome(service.statistics(), most_at_once)


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds:.3g} s"


def timing(histogram: tickler.Histogram, what: str, done: str) -> str:
    """A histogram as one line: how many, the mean, and the bucket bound none exceeded."""
    if histogram.count == 0:
        return f"no {what}"
    mean = _duration(histogram.sum / histogram.count)
    line = f"{histogram.count} {what} {done} {mean} on average"
    cumulative = histogram.cumulative()
    for bound, at_or_below in zip(histogram.bounds, cumulative, strict=False):
        if at_or_below == histogram.count:
            return f"{line}, none longer than {_duration(bound)}"
    return f"{line}, some longer than {_duration(histogram.bounds[-1])}"


def summary(outcome: Outcome) -> str:
    """One line on what the run showed, from its measurements."""
    stats = outcome.statistics
    missing = stats.enqueued - stats.succeeded
    return ", ".join(
        [
            f"{stats.enqueued} request{'' if stats.enqueued == 1 else 's'}",
            f"never more than {outcome.most_at_once} at once",
            f"up to {stats.peak_queued} waiting",
            "none lost" if missing == 0 else f"{missing} not completed",
        ]
    )


def report(outcome: Outcome) -> str:
    """The final statistics, the timings, and last the one-line summary."""
    stats = outcome.statistics
    lines = ["", "final statistics:"]
    for field, value in attrs.asdict(stats, recurse=False).items():
        if not isinstance(value, tickler.Histogram | None):
            lines.append(f"  {field:>20}: {value}")
    if stats.wait_time is not None:
        lines.append(f"  {'wait_time':>20}: {timing(stats.wait_time, 'requests', 'waited')}")
    if stats.run_time is not None:
        lines.append(f"  {'run_time':>20}: {timing(stats.run_time, 'attempts', 'ran')}")
    lines.append("")
    lines.append(summary(outcome))
    return "\n".join(lines)


if __name__ == "__main__":
    args = parse_args()
    logging.basicConfig(
        level=logging.DEBUG,
        format="%(relativeCreated)6.0f ms %(name)-7s %(message)s",
        stream=sys.stdout,
    )
    print(report(trio.run(main, args.capacity, args.requests, args.burst, args.seed)))
