"""examples/site_manager's GET /metrics over a real socket: the replica's /stats, for Prometheus."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import httpx
import prometheus_client
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.test_site_manager import create, running, settings, wait_for

SERVICE = "site_manager"
COUNTERS = (
    "enqueued",
    "succeeded",
    "failed",
    "cancelled",
    "retried",
    "rejected",
    "deduplicated",
)
GAUGES = ("queued", "scheduled", "in_flight", "retrying")


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples_of(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["service"] == SERVICE
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset({"service": SERVICE, **labels}.items())]


def check(text: str, stats: dict[str, Any]) -> None:
    """Every series of the scrape against /stats: the replica's statistics, the store's counts."""
    samples = samples_of(text)
    replica = stats["replica"]
    for field in COUNTERS:
        assert sample(samples, f"tickler_requests_{field}_total") == replica[field], field
    assert sample(samples, "tickler_attempts_started_total") == replica["started"]
    assert sample(samples, "tickler_store_errors_total") == replica["store_errors"]
    for field in GAUGES:
        assert sample(samples, f"tickler_requests_{field}") == replica[field], field
    assert sample(samples, "tickler_capacity") == replica["capacity"]
    assert sample(samples, "tickler_max_queue_length") == replica["max_queue_length"]
    for name, field in (
        ("tickler_request_wait_seconds", "wait_time"),
        ("tickler_attempt_run_seconds", "run_time"),
    ):
        histogram = replica[field]
        les = [str(bound) for bound in histogram["bounds"]] + ["+Inf"]
        cumulative = list(itertools.accumulate(histogram["counts"]))
        for le, count in zip(les, cumulative, strict=True):
            assert sample(samples, f"{name}_bucket", le=le) == count, (name, le)
        assert sample(samples, f"{name}_count") == cumulative[-1]
        assert sample(samples, f"{name}_sum") == histogram["sum"]
    for status, count in stats["store"].items():
        if status == "paused":  # a flag beside the counts, shown as tickler_paused
            assert sample(samples, "tickler_paused") == count
            continue
        if status == "limited":  # shown as tickler_requests_limited (this process's count)
            continue
        if status.startswith("rescued_"):  # the store's rescues so far, by reason
            reason = status.removeprefix("rescued_")
            assert sample(samples, "tickler_store_rescues_total", reason=reason) == count
            continue
        assert sample(samples, "tickler_store_requests", status=status) == count, status
    for reason in ("owner_died", "lease_lapsed"):  # this replica's claims' rescues
        rescued = replica[f"rescued_{reason}"]
        assert sample(samples, "tickler_rescues_total", reason=reason) == rescued
    assert sample(samples, "tickler_store_up") == 1
    # Nothing else: 8 counters, 7 gauges, 2 x (25 buckets, count, sum), 2 rescue reasons,
    # the store's counts (its 7 states, and its 2 rescue reasons), up.
    assert len(samples) == 8 + 1 + 4 + 2 + 2 * 27 + 2 + len(stats["store"]) + 1


def stable(stats: dict[str, Any]) -> dict[str, Any]:
    """/stats less what moves while the replica is idle (the loop's wake-ups)."""
    replica = {k: v for k, v in stats["replica"].items() if k not in ("wakeups", "peak_queued")}
    return {"replica": replica, "store": stats["store"]}


async def test_get_metrics_is_the_replicas_statistics_and_the_stores_counts(tmp_path: Path) -> None:
    async with (
        running(settings(tmp_path, fail_rate=0.3, seed=11)) as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        response = await client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
        check(response.text, (await client.get("/stats")).json())
        assert sample(samples_of(response.text), "tickler_requests_enqueued_total") == 0

        ids = [(await create(client, i)).json()["id"] for i in range(20)]
        assert (await client.delete(f"/sites/{ids[-1]}")).status_code == 202
        await wait_for(client, ids[:-1], "running")
        await wait_for(client, ids[-1:], "deleted")
        with trio.fail_after(20):  # the last steps' outcomes reach the store
            while True:
                stats = (await client.get("/stats")).json()
                live = ("queued", "scheduled", "running", "retrying")
                if not any(stats["store"][status] for status in live):
                    break
                await trio.sleep(0.05)

        before = (await client.get("/stats")).json()
        response = await client.get("/metrics")
        after = (await client.get("/stats")).json()
    assert stable(before) == stable(after)
    check(response.text, after)
    samples = samples_of(response.text)
    # Every creation step ran, some of them more than once.
    assert sample(samples, "tickler_store_requests", status="succeeded") >= 4 * 19
    assert sample(samples, "tickler_requests_retried_total") > 0
    assert sample(samples, "tickler_attempt_run_seconds_count") == after["replica"]["started"]
