"""The persistent store: one sqlite database of byte values, kept between processes.

Entries are ``(namespace, key) -> bytes``; each row also holds the value's size, its sha256 (checked
on every read), when it was written and when it was last read. Past a byte limit the least recently
used entries go first. It holds which of Inductor's vector-ISA test libraries load
(``executors/fusion/isa_probe.py``) and each fused region's compiled module
(``executors/fusion/kernel_store.py``), and jitted modules' captured programs
(``persist/programs.py``).

The store cannot hurt: a store that fails (a corrupted or truncated file, a checksum mismatch, a
read-only or missing directory, a full disk, a lock held past the timeout) behaves as an empty one.
``get`` returns None, ``put`` does nothing, neither raises, and each cause warns once per process
with the path and what to do. A corrupted database is renamed ``*.corrupt`` and the next open
makes a new one.

>>> import tempfile
>>> store = Store(tempfile.mkdtemp())
>>> store.put("programs", "abc", b"compiled")
>>> store.get("programs", "abc")
b'compiled'
>>> store.get("programs", "missing") is None
True

Where it lives: ``$KERAUNOS_CACHE_DIR``, else ``$XDG_CACHE_HOME/keraunos``, else
``~/.cache/keraunos``. ``$KERAUNOS_STORE_MAX_BYTES`` sets the limit (default 1 GiB).
``keraunos cache info`` and ``keraunos cache clear`` show and empty it.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sqlite3
import threading
import time
import warnings

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_TIMEOUT = 5.0  # seconds a writer waits for another process's lock before giving up
FILENAME = "store.sqlite3"

_SCHEMA = """CREATE TABLE IF NOT EXISTS entries (
    namespace TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, size INTEGER NOT NULL,
    checksum TEXT NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL,
    PRIMARY KEY (namespace, key))"""

_warned: set[str] = set()  # causes already warned about in this process


def default_directory() -> pathlib.Path:
    """``$KERAUNOS_CACHE_DIR``, else ``$XDG_CACHE_HOME/keraunos``, else ``~/.cache/keraunos``."""
    if os.environ.get("KERAUNOS_CACHE_DIR"):
        return pathlib.Path(os.environ["KERAUNOS_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "keraunos"


def _default_max_bytes() -> int:
    text = os.environ.get("KERAUNOS_STORE_MAX_BYTES", "")
    try:
        return int(text) if text else DEFAULT_MAX_BYTES
    except ValueError:
        _warn_once("max_bytes", f"KERAUNOS_STORE_MAX_BYTES={text!r} is not a whole number of "
                                f"bytes; the store uses its default limit ({DEFAULT_MAX_BYTES})")
        return DEFAULT_MAX_BYTES


def _warn_once(cause: str, message: str) -> None:
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cause(error: BaseException) -> str:
    """What went wrong, as one of a few causes (each warns once)."""
    if isinstance(error, ChecksumError):
        return "checksum"
    if isinstance(error, sqlite3.DatabaseError):
        name = getattr(error, "sqlite_errorname", "")
        text = str(error).lower()
        if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in text \
                or "not a database" in text:
            return "corrupt"
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
            return "locked"
        if name.startswith("SQLITE_FULL") or "full" in text:
            return "full"
        if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) \
                or "readonly" in text or "unable to open" in text:
            return "unwritable"
    if isinstance(error, OSError):
        return "unwritable"
    return "error"


_ADVICE = {
    "corrupt": "the database file was corrupted; it was moved aside (*.corrupt) and a new one "
               "is made",
    "checksum": "a stored value did not match its checksum; it was dropped",
    "locked": "another process held the database's lock past the timeout",
    "full": "the disk (or the database's page limit) is full",
    "unwritable": "the directory cannot be created or written",
    "error": "the database failed",
}


class ChecksumError(Exception):
    """A stored value's sha256 is not the one recorded with it."""


class Store:
    """A sqlite database of ``(namespace, key) -> bytes`` in ``directory``, safe to share
    between processes and threads. ``get`` and ``put`` never raise; see the module docstring.

    >>> import tempfile
    >>> store = Store(tempfile.mkdtemp(), max_bytes=10)
    >>> store.put("ns", "a", b"12345"); store.put("ns", "b", b"12345")
    >>> store.get("ns", "a"); store.put("ns", "c", b"12345")  # b is the least recently used
    b'12345'
    >>> store.get("ns", "b") is None, store.info()["entries"]
    (True, 2)
    """

    def __init__(self, directory: str | os.PathLike | None = None, max_bytes: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT):
        self.directory = pathlib.Path(directory) if directory is not None else default_directory()
        self.path = self.directory / FILENAME
        self.max_bytes = max_bytes if max_bytes is not None else _default_max_bytes()
        self.timeout = timeout
        self._lock = threading.RLock()
        self._connection: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._clock = 0.0

    # -- the public operations: none of them raises --------------------------------------------

    def get(self, namespace: str, key: str) -> bytes | None:
        """The value stored under ``(namespace, key)``, or None (absent, or the store failed)."""
        with self._lock:
            try:
                row = self._connect().execute(
                    "SELECT value, size, checksum FROM entries WHERE namespace = ? AND key = ?",
                    (namespace, key)).fetchone()
                if row is None:
                    return None
                value = bytes(row[0])
                if len(value) != row[1] or hashlib.sha256(value).hexdigest() != row[2]:
                    self._delete(namespace, key)
                    raise ChecksumError(f"{namespace}/{key}")
            except Exception as error:  # noqa: BLE001 - a failing store is an empty store
                self._failed(error)
                return None
            try:  # the value is good; a failed last-use update only makes eviction less exact
                self._connection.execute(
                    "UPDATE entries SET last_used = ? WHERE namespace = ? AND key = ?",
                    (self._now(), namespace, key))
            except Exception as error:  # noqa: BLE001
                self._failed(error)
            return value

    def put(self, namespace: str, key: str, value: bytes) -> None:
        """Store ``value`` under ``(namespace, key)``, replacing what was there; evict the least
        recently used entries past the limit. A value larger than the limit is not stored."""
        value = bytes(value)
        if len(value) > self.max_bytes:
            return
        with self._lock:
            try:
                connection = self._connect()
                now = self._now()
                connection.execute("BEGIN IMMEDIATE")
                try:
                    connection.execute(
                        "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (namespace, key, value, len(value), hashlib.sha256(value).hexdigest(),
                         now, now))
                    self._evict(connection)
                    connection.execute("COMMIT")
                except BaseException:
                    if connection.in_transaction:
                        connection.execute("ROLLBACK")
                    raise
            except Exception as error:  # noqa: BLE001
                self._failed(error)

    def info(self) -> dict:
        """``entries``, ``bytes``, ``path``, ``limit``; ``error`` says why the counts are 0 when
        the store cannot be read (None otherwise)."""
        result = {"entries": 0, "bytes": 0, "path": str(self.path), "limit": self.max_bytes,
                  "error": None}
        with self._lock:
            try:
                count, total = self._connect().execute(
                    "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone()
                result.update(entries=count, bytes=total)
            except Exception as error:  # noqa: BLE001
                result["error"] = f"{_ADVICE[_cause(error)]} ({error})"
                self._failed(error)
        return result

    def clear(self) -> bool:
        """Remove every entry (and any ``*.corrupt`` file set aside). True when the store is
        empty afterwards; a database that cannot be opened is deleted instead."""
        with self._lock:
            try:
                connection = self._connect()
                connection.execute("DELETE FROM entries")
                connection.execute("VACUUM")  # give the space back to the disk
            except Exception:  # noqa: BLE001 - a broken database is removed whole
                self.close()
                for path in self._files():
                    try:
                        path.unlink(missing_ok=True)
                    except OSError:
                        return False
            for path in self.directory.glob(FILENAME + "*.corrupt"):
                try:
                    path.unlink()
                except OSError:
                    return False
            return True

    def close(self) -> None:
        """Close the database connection (the next operation opens it again)."""
        with self._lock:
            if self._connection is not None:
                try:
                    self._connection.close()
                except Exception:  # noqa: BLE001
                    pass
                self._connection = None

    # -- internals ----------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._connection is not None and self._pid == os.getpid():
            return self._connection
        self._connection, self._pid = None, os.getpid()  # a forked child opens its own
        self.directory.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None,
                                     check_same_thread=False)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")  # WAL: survives a killed process
            connection.execute(_SCHEMA)
            connection.execute("CREATE INDEX IF NOT EXISTS by_last_use ON entries (last_used)")
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        return connection

    def _now(self) -> float:
        # Strictly increasing within the process, so that two uses never tie in LRU order.
        self._clock = max(time.time(), self._clock + 1e-6)
        return self._clock

    def _evict(self, connection: sqlite3.Connection) -> None:
        (total,) = connection.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        if total <= self.max_bytes:
            return
        rows = connection.execute(
            "SELECT namespace, key, size FROM entries ORDER BY last_used, rowid").fetchall()
        for namespace, key, size in rows:
            if total <= self.max_bytes:
                break
            connection.execute("DELETE FROM entries WHERE namespace = ? AND key = ?",
                               (namespace, key))
            total -= size

    def _delete(self, namespace: str, key: str) -> None:
        try:
            self._connection.execute("DELETE FROM entries WHERE namespace = ? AND key = ?",
                                     (namespace, key))
        except Exception as error:  # noqa: BLE001
            self._failed(error)

    def _files(self) -> list[pathlib.Path]:
        return [self.path.with_name(FILENAME + suffix) for suffix in ("", "-wal", "-shm")]

    def _failed(self, error: BaseException) -> None:
        cause = _cause(error)
        if cause == "corrupt":
            self._move_aside()
        _warn_once(cause, f"keraunos store {self.path}: {_ADVICE[cause]} ({error}); keraunos "
                          f"carries on without it. Run `keraunos cache clear`, or set "
                          f"KERAUNOS_CACHE_DIR to another directory.")

    def _move_aside(self) -> None:
        # The WAL and shared-memory files go too: a new database must not replay an old WAL.
        self.close()
        stamp = f".{os.getpid()}.{int(time.time())}.corrupt"
        for path in self._files():
            try:
                path.rename(path.with_name(path.name + stamp))
            except OSError:
                pass


_default: Store | None = None
_default_lock = threading.Lock()


def default_store() -> Store:
    """This process's store (in ``default_directory()``), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Store()
        return _default
