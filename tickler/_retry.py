"""The retry policy: how many attempts, how long to wait between them, for which errors."""

from __future__ import annotations

import math
import random
from typing import Any

import attrs

from ._core import _check_delay


def _check_number(name: str, value: object, *, finite: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number")
    try:
        as_float = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite") from None
    if math.isnan(as_float):
        raise ValueError(f"{name} must not be NaN")
    if finite and math.isinf(as_float):
        raise ValueError(f"{name} must be finite")


def _to_exception_types(value: object) -> tuple[type[Exception], ...]:
    types = value if isinstance(value, tuple) else (value,)
    for item in types:
        if not (isinstance(item, type) and issubclass(item, Exception)):
            raise TypeError("on must be an Exception subclass or a tuple of them")
    if not types:
        raise ValueError("on must name at least one exception type")
    return types


@attrs.frozen
class Retry:
    """Retry failed attempts with capped exponential backoff.

    ``attempts`` counts every attempt, the first one included; ``None``
    retries until the request succeeds, is cancelled, or a stop's timeout
    ends it. Before attempt ``k + 1`` the request waits
    ``min(maximum, initial * factor ** (k - 1))`` seconds; with ``jitter`` the
    wait is drawn uniformly from the upper half of that. Only exceptions that
    are instances of ``on`` are retried.
    """

    attempts: int | None = attrs.field(default=3)
    initial: float = attrs.field(default=0.1)
    factor: float = attrs.field(default=2.0)
    maximum: float = attrs.field(default=30.0)
    jitter: bool = attrs.field(default=True)
    on: tuple[type[Exception], ...] = attrs.field(
        default=(Exception,), converter=_to_exception_types
    )

    @attempts.validator
    def _check_attempts(self, _: Any, value: int | None) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("attempts must be an int or None")
        if value < 1:
            raise ValueError("attempts must be >= 1 or None")

    @initial.validator
    def _check_initial(self, _: Any, value: float) -> None:
        _check_number("initial", value)
        if value < 0:
            raise ValueError("initial must be >= 0")

    @factor.validator
    def _check_factor(self, _: Any, value: float) -> None:
        _check_number("factor", value, finite=False)
        if value < 1:
            raise ValueError("factor must be >= 1")

    @maximum.validator
    def _check_maximum(self, _: Any, value: float) -> None:
        _check_number("maximum", value)
        if value < 0:
            raise ValueError("maximum must be >= 0")
        _check_delay(value, "maximum")  # a retry waits at most as long as a delay may

    @jitter.validator
    def _check_jitter(self, _: Any, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError("jitter must be a bool")

    def backoff(self, attempt: int) -> float:
        """The wait in seconds after failed attempt number ``attempt`` (1-based), before jitter.

        Always finite: ``initial`` and ``maximum`` are, and a growth past
        ``maximum`` (or past what a float holds) gives ``maximum``.
        """
        if self.initial == 0 or attempt <= 1:
            return float(min(self.maximum, self.initial))
        try:
            # float: an int factor would grow an exact integer without bound.
            delay = self.initial * float(self.factor) ** (attempt - 1)
        except OverflowError:
            return float(self.maximum)
        return float(min(self.maximum, delay))

    def delay(self, attempt: int) -> float:
        """The wait in seconds after failed attempt number ``attempt``, jitter applied."""
        delay = self.backoff(attempt)
        if self.jitter:
            return random.uniform(delay / 2, delay)  # noqa: S311 - backoff jitter, not cryptography
        return delay

    def should_retry(self, attempt: int, exc: Exception) -> bool:
        """Whether failed attempt number ``attempt`` raising ``exc`` gets another attempt."""
        attempts = self.attempts
        return (attempts is None or attempt < attempts) and isinstance(exc, self.on)
