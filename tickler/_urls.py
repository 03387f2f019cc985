"""Store URLs as the command line and the dashboard take them, and passwords kept out of
every message about them.

A URL is ``sqlite:///relative.db``, ``sqlite:////absolute.db``, or a ``postgresql://``
DSN. Both ``python -m tickler`` and ``tickler.web`` import from here.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

from ._stores import postgres, sqlite

_PREFIX = "sqlite:///"
_MASK = "***"

# A URL's user:password@, up to the last @ before a /: libpq and urllib split a
# password that holds @ differently, and both readings must be hidden.
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@'\"]*:)[^\s/'\"]*@")
# password=... in a key=value connection string or a URL's query: quoted, or a
# word; in a message, a word ends at a quote too.
_KEYWORD_PASSWORD = re.compile(r"\bpassword\s*=\s*('(?:[^'\\]|\\.)*'?|\S*)", re.IGNORECASE)
_MESSAGE_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s'\"]*)", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"[?&]password=([^&#\s]*)", re.IGNORECASE)


def _passwords(source: str) -> set[str]:
    """The passwords ``source`` may hold, as written and decoded, and their parts.

    ``source`` is a URL or a key=value connection string as the user typed it,
    well formed or not: libpq quotes a malformed one, or a piece of it, in its errors.
    """
    found: set[str] = set()
    for match in re.finditer(r"://(\S*)", source):
        rest = match.group(1)
        libpq = re.match(r"[^@/]*(?=@)", rest)  # libpq: user info ends at the first @ or /
        readings = [
            libpq.group() if libpq else "",
            re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[0],  # urllib
            re.split(r"[?#]", rest, maxsplit=1)[0].rpartition("@")[0],  # a / in the password
        ]
        for userinfo in readings:
            if ":" in userinfo:
                password = userinfo.partition(":")[2]
                found.add(password)
                found.update(re.split(r"[@/?#]", password))
        found.update(_QUERY_PASSWORD.findall(rest))
    for match in _KEYWORD_PASSWORD.finditer(source):
        value = match.group(1)
        if value.startswith("'"):
            value = value[1:-1] if len(value) > 1 and value.endswith("'") else value[1:]
        found.update((match.group(1), value, re.sub(r"\\(.)", r"\1", value)))
    found.update([urllib.parse.unquote(password) for password in found])
    found.discard("")
    return found


def redact(text: str, sources: Iterable[str] = (), secrets: Iterable[str] = ()) -> str:
    """``text`` with the passwords of ``sources``, ``secrets`` themselves, and the passwords
    of URLs in it, as ***."""
    secrets = {secret for secret in secrets if secret}
    for source in sources:
        secrets |= _passwords(source)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, _MASK)
    text = _URL_PASSWORD.sub(rf"\1{_MASK}@", text)
    return _MESSAGE_PASSWORD.sub(rf"\1{_MASK}", text)


def _is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def open_store(
    url: str, *, schema: str = "tickler", create: bool = False
) -> sqlite.SqliteStore | postgres.PostgresStore:
    """The store at ``url``: a ``sqlite:///`` URL (relative path; ``sqlite:////`` for an
    absolute one) or a ``postgresql://`` DSN, with ``schema``.

    Nothing is opened yet. A SQLite file must exist unless ``create``.

    Raises:
        ValueError: another kind of URL, or a missing file; the message shows no password.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, not {type(url).__name__}")
    if _is_postgres(url):
        return postgres.PostgresStore(url, schema=schema)
    if url.startswith(_PREFIX):
        path = Path(url[len(_PREFIX) :])
        if not create and not path.is_file():
            raise ValueError(f"{path}: no such file")
        return sqlite.SqliteStore(path)
    raise ValueError(f"{redact(url, [url])!r} is neither a sqlite:/// URL nor a postgresql:// DSN")
