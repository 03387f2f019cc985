"""What mypy --strict proves about tickler's types; checked, never run.

Positive cases use ``assert_type``. Each line that must be a type error
carries ``# type: ignore[<code>]``: with ``warn_unused_ignores`` (part of
strict), mypy fails if such a line ever stops being an error.
"""

from __future__ import annotations

from typing import Any, assert_type

import attrs

import tickler


@attrs.frozen
class Order:
    item: str


@attrs.frozen
class Receipt:
    total: int


async def place(order: Order) -> Receipt:
    return Receipt(len(order.item))


def on_failure(ticket: tickler.Ticket[Order, Receipt], exc: Exception) -> None:
    assert_type(ticket.request, Order)


def wrong_hook(ticket: tickler.Ticket[str, Receipt], exc: Exception) -> None:
    pass


async def checks() -> None:
    service = tickler.Service(place, on_error=on_failure)
    assert_type(service, tickler.Service[Order, Receipt])

    ticket = service.enqueue_request(Order("tea"))
    assert_type(ticket, tickler.Ticket[Order, Receipt])
    assert_type(ticket.request, Order)
    assert_type(await ticket.wait(), Receipt)
    assert_type(ticket.result(), Receipt)
    assert_type(await service.stop(), list[tickler.Ticket[Order, Receipt]])

    keyed = service.enqueue_request(Order("tea"), key=("order", 1), delay=2.5)
    assert_type(keyed, tickler.Ticket[Order, Receipt])
    assert_type(await service.submit(Order("tea")), tickler.Ticket[Order, Receipt])
    assert_type(
        await service.submit(Order("tea"), key="k", delay=1), tickler.Ticket[Order, Receipt]
    )
    assert_type(tickler.current_service(), tickler.Service[Any, Any])
    assert_type(tickler.current_ticket(), tickler.Ticket[Any, Any])

    service.enqueue_request(42)  # type: ignore[arg-type]
    await service.submit(42)  # type: ignore[arg-type]
    service.enqueue_request(Order("tea"), key=["not", "hashable"])  # type: ignore[arg-type]
    service.enqueue_request(Order("tea"), delay="1")  # type: ignore[arg-type]
    wrong: str = await ticket.wait()  # type: ignore[assignment]
    tickler.Service(place, on_error=wrong_hook)  # type: ignore[misc]

    async with tickler.open_service(place) as opened:
        assert_type(opened, tickler.Service[Order, Receipt])
        assert_type(opened.enqueue_request(Order("cake")), tickler.Ticket[Order, Receipt])
        opened.enqueue_request("cake")  # type: ignore[arg-type]

    def not_async(order: Order) -> Receipt:
        return Receipt(0)

    tickler.Service(not_async)  # type: ignore[arg-type]
    del wrong
