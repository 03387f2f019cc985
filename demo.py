"""Watch the tickler pattern's log dance.

Requests arrive at random 0-100 ms intervals and each takes 0-500 ms; then a
burst arrives with no delay, the queue grows, and the limit is reached. The
supervisor loop's DEBUG lines show each enqueue, dequeue and replenishment.

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


async def main(capacity: int, requests: int, burst: int, seed: int) -> tickler.ServiceStatistics:
    """Run the demo and return the service's final statistics."""
    rng = random.Random(seed)  # noqa: S311 - simulated arrival times, not secrets
    log = logging.getLogger("demo")

    async def handle(request: str) -> str:
        await trio.sleep(rng.uniform(0.0, 0.5))
        log.info("%s done", request)
        return request

    async with tickler.open_service(handle, capacity=capacity, name="demo") as service:
        log.info("phase 1: %d requests at random 0-100 ms intervals", requests)
        for i in range(requests):
            service.enqueue_request(f"request-{i}")
            await trio.sleep(rng.uniform(0.0, 0.1))
        log.info("phase 2: a burst of %d requests with no delay", burst)
        for i in range(burst):
            service.enqueue_request(f"burst-{i}")
        log.info("draining")
    return service.statistics()


if __name__ == "__main__":
    args = parse_args()
    logging.basicConfig(
        level=logging.DEBUG,
        format="%(relativeCreated)6.0f ms %(name)-7s %(message)s",
        stream=sys.stdout,
    )
    stats = trio.run(main, args.capacity, args.requests, args.burst, args.seed)
    print("\nfinal statistics:")
    for field, value in attrs.asdict(stats).items():
        print(f"  {field:>16}: {value}")
