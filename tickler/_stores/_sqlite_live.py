"""SQLite's liveness locks: one byte of a file beside the database per owner, locked by the
kernel for as long as the process that holds it lives.

Each service's session holds an open file description lock (Linux's F_OFD_SETLK) on
the byte of ``<database>-tickler-live`` that its owner id names. The kernel releases it
when the process dies, however it dies; a stopped process (SIGSTOP) keeps it. Another
session asks the kernel whether a byte is free (F_OFD_GETLK) without taking it: an
owner whose byte is free has no live process, and its rows may be rescued at once.
Open file description locks conflict between two descriptions of one process too, so
two services of one process tell each other's locks apart.

Where the kernel has no such locks, nothing is held and every owner counts as alive:
the lease alone rescues.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
from pathlib import Path

# Whether this kernel has open file description locks.
SUPPORTED = hasattr(fcntl, "F_OFD_SETLK") and hasattr(fcntl, "F_OFD_GETLK")

# struct flock: l_type, l_whence, l_start, l_len, l_pid, padded as the C struct is.
_FLOCK = "hhqqi4x"


def path_of(database: Path) -> Path:
    """The lock file beside a database file."""
    return database.with_name(database.name + "-tickler-live")


def byte_of(owner: str) -> int:
    """The byte an owner id locks: 62 bits of its hash."""
    return int.from_bytes(hashlib.sha256(owner.encode()).digest()[:8], "big") >> 2


def _flock(kind: int, offset: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0)


def _free(fd: int, owner: str) -> bool:
    """Whether ``owner``'s byte is free, asked of the kernel on ``fd`` without taking it."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, byte_of(owner)))
    return bool(struct.unpack(_FLOCK, answer)[0] == fcntl.F_UNLCK)


class Liveness:
    """One session's lock, and its looks at other owners' locks."""

    def __init__(self, database: Path) -> None:
        self.path = path_of(database)
        self.fd: int | None = None
        self.owner: str | None = None

    def hold(self, owner: str, check: bool) -> bool:
        """Hold ``owner``'s lock (taking it, the first time); True if it was lost.

        Lost: the lock file was replaced or deleted under this session (its lock no
        longer counts for the other processes), or another description holds the byte.
        The caller then takes a new owner id. ``check``: look whether it still holds.
        """
        if not SUPPORTED:
            return False
        if owner != self.owner:
            self.release()
            self._open()
            assert self.fd is not None
            try:
                fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, byte_of(owner)))
            except OSError:
                return True  # (another owner id with the same byte: take another)
            self.owner = owner
            return False
        if check and self.fd is not None:
            try:
                same = os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                self.release()
                return True
        return False

    def dead(self, owners: list[str]) -> list[str]:
        """Those of ``owners`` whose lock is free."""
        if not SUPPORTED or not owners:
            return []
        if self.fd is None:
            self._open()
        assert self.fd is not None
        return [owner for owner in owners if _free(self.fd, owner)]

    def held(self, owners: list[str]) -> list[str]:
        """Those of ``owners`` whose lock is held, asked on a description of the lock file
        opened read-only: this creates and writes nothing (no lock file: none is held).
        Where the kernel has no such locks, every one counts as held."""
        if not SUPPORTED:
            return list(owners)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        try:
            return [owner for owner in owners if not _free(fd, owner)]
        finally:
            os.close(fd)

    def release(self) -> None:
        """Give the lock up (closing the description releases it)."""
        fd, self.fd, self.owner = self.fd, None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
