"""How a store turns requests and results into bytes."""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Codec(Protocol):
    """Anything with ``encode(obj) -> bytes`` and ``decode(bytes) -> obj``."""

    def encode(self, obj: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


# One encoder and decoder for every call: json.dumps with options builds a new
# encoder each time, which costs more than encoding a small request.
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_DECODE = json.JSONDecoder().decode


class JsonCodec:
    """JSON, as UTF-8: the default codec of a service with a store.

    Tuples come back as lists, as JSON has no tuple. ``encode`` raises
    TypeError naming the type of what it cannot encode.
    """

    __slots__ = ()

    def encode(self, obj: Any) -> bytes:
        if obj is None:  # what most handlers return
            return b"null"
        try:
            return _ENCODE(obj).encode()
        except (TypeError, ValueError) as exc:
            raise TypeError(f"JsonCodec cannot encode {type(obj).__name__}: {exc}") from None

    def decode(self, data: bytes) -> Any:
        return _DECODE(data.decode())

    def __repr__(self) -> str:
        return "tickler.JsonCodec()"


def check_codec(codec: object) -> Codec:
    if not callable(getattr(codec, "encode", None)) or not callable(getattr(codec, "decode", None)):
        raise TypeError("codec must have encode(obj) -> bytes and decode(bytes) -> obj methods")
    return codec  # type: ignore[return-value]


def encode_key(key: object) -> str:
    """A key as the store keeps it: canonical JSON of a str, or of a tuple of strs and ints.

    Not a bare int: cancel() and lookup() take an int as a request's id.
    """

    def check(part: object, top: bool) -> None:
        if isinstance(part, tuple):
            for item in part:
                check(item, False)
        elif isinstance(part, bool) or not isinstance(part, str if top else str | int):
            raise TypeError(
                "key must be a str or a tuple of strs and ints for a service with a store,"
                f" not {type(part).__name__}"
            )

    check(key, True)
    return json.dumps(key, separators=(",", ":"))
