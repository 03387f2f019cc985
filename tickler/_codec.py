"""How a store turns requests and results into bytes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Codec(Protocol):
    """Anything with ``encode(obj) -> bytes`` and ``decode(bytes) -> obj``."""

    def encode(self, obj: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


# tuned (bench: SqliteStore burst, pg drain): one encoder and decoder for every call: json.dumps
# with options builds a new encoder each time, which costs more than encoding a small request.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_ENCODE = _ENCODER.encode
_DECODER = json.JSONDecoder()
_DECODE = _DECODER.decode
# serves: pg drain: the scanner JSONDecoder.decode calls (through raw_decode), called
# directly: text with no whitespace around it, as JsonCodec writes it, is decoded without
# the two regular-expression matches and two calls around the scan (see JsonCodec.decode).
_SCAN: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]


def _c_encoder() -> Any:
    """json's C encoder with _ENCODER's options, built once; None where there is none.

    JSONEncoder.encode builds it again for every call, which costs as much as
    encoding a small request. This one keeps no record of the containers it
    is in (as check_circular=False), so a cycle ends in RecursionError, which
    encode() turns into the TypeError that JSONEncoder's ValueError becomes.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        iterate = make(
            None,
            _ENCODER.default,
            json.encoder.encode_basestring_ascii,
            None,
            ":",
            ",",
            False,
            False,
            False,
        )
        sample = {"a": [1, 2.5, None, True, "\u00e9\n"], "b": {"c": -3}}
        if "".join(iterate(sample, 0)) != _ENCODE(sample):
            return None
    except Exception:
        return None
    return iterate


_C_ENCODE = _c_encoder()


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
            if _C_ENCODE is None or type(obj) is str:
                return _ENCODE(obj).encode()
            return "".join(_C_ENCODE(obj, 0)).encode()
        except (TypeError, ValueError) as exc:
            raise TypeError(f"JsonCodec cannot encode {type(obj).__name__}: {exc}") from None
        except RecursionError:
            kind = type(obj).__name__
            raise TypeError(
                f"JsonCodec cannot encode {kind}: it contains itself or nests too deep"
            ) from None

    def decode(self, data: bytes) -> Any:
        text = data.decode()
        # serves: pg drain (a decode per claimed request): the scan from 0 is what _DECODE
        # does when no whitespace leads; what it leaves over (whitespace or not) or cannot
        # start on goes to _DECODE, which skips whitespace, or raises as it always did.
        try:
            obj, end = _SCAN(text, 0)
        except StopIteration:
            return _DECODE(text)
        return obj if end == len(text) else _DECODE(text)

    def __repr__(self) -> str:
        return "tickler.JsonCodec()"


def check_codec(codec: object) -> Codec:
    if not callable(getattr(codec, "encode", None)) or not callable(getattr(codec, "decode", None)):
        raise TypeError("codec must have encode(obj) -> bytes and decode(bytes) -> obj methods")
    return codec  # type: ignore[return-value]


def encode_key(key: object) -> str:
    """A key as the store keeps it in the ``key`` column: its canonical JSON.

    The text is ``json.dumps(key, separators=(",", ":"))``, ASCII only
    (other characters as ``\\uXXXX`` escapes): the str key ``k`` is kept as
    ``"k"``, quotes included, and the tuple ``("order", 7)`` as
    ``["order",7]``. A row inserted by another program de-duplicates against
    tickler's only if its key is encoded so.

    Not a bare int: cancel() and lookup() take an int as a request's id.

    Raises:
        TypeError: the key is not a str or a tuple of strs and ints.
        ValueError: its encoding is over MAX_KEY_BYTES.
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
    text = json.dumps(key, separators=(",", ":"))
    if len(text) > MAX_KEY_BYTES:  # (ASCII: one byte a character)
        raise ValueError(
            f"key must be at most MAX_KEY_BYTES ({MAX_KEY_BYTES}) bytes once encoded as the"
            f" store keeps it (canonical JSON), not {len(text)}"
        )
    return text


# A queue name and a key share one entry of the index of live keys
# (queue, key), and PostgreSQL refuses an index entry over about 2,700 bytes:
# each is bounded so that both together always fit, in every store alike.
MAX_QUEUE_BYTES = 1000
MAX_KEY_BYTES = 1000


def check_queue_name(name: object, what: str) -> str:
    """A queue name, checked: a str a store can keep; ``what`` names the parameter.

    The one rule for every part that takes a queue's name (a service with a store,
    the stores' enqueue_in and enqueue_many_in, the admin, the command line).

    Raises:
        TypeError: it is not a str.
        ValueError: it holds a NUL or a lone surrogate, or is over MAX_QUEUE_BYTES.
    """
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    if "\x00" in name:
        raise ValueError(f"{what} must not contain NUL characters: it names the store's queue")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(
            f"{what} must be valid Unicode text (no lone surrogates): it names the store's queue"
        ) from None
    if size > MAX_QUEUE_BYTES:
        raise ValueError(
            f"{what} must be at most {MAX_QUEUE_BYTES} bytes in UTF-8 with a store,"
            f" not {size}: it names the store's queue"
        )
    return name


# The longest group name, and periodic request name, in bytes of UTF-8 (each is a column).
MAX_GROUP_BYTES = 200


def check_short_name(value: object, what: str) -> str:
    """A group's or a periodic request's name, checked: a str of 1 to 200 bytes of UTF-8,
    with no NUL and no lone surrogate (what every store can keep); ``what`` names it."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    # tuned (bench: groups): an ASCII name holds no surrogate and is as long in UTF-8.
    if value.isascii() and 0 < len(value) <= MAX_GROUP_BYTES and "\x00" not in value:
        return value
    if "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise ValueError(f"{what} must not hold a NUL or a lone surrogate")
    if not 0 < len(value.encode("utf-8")) <= MAX_GROUP_BYTES:
        raise ValueError(f"{what} must be 1 to {MAX_GROUP_BYTES} bytes of UTF-8")
    return value


def check_group(value: object) -> str | None:
    """A request's group, checked: None, or a name as check_short_name takes it."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"group must be a str or None, not {type(value).__name__}")
    return check_short_name(value, "group")
