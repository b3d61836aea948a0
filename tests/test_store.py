"""The persistent store (keraunos.store) keeps bytes between processes and cannot hurt: every
failure reads as an empty store, with one warning per cause, and never raises."""
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from keraunos.persist import store as store_module
from keraunos.persist.store import Store, default_directory


@pytest.fixture(autouse=True)
def fresh_warnings():
    store_module._warned.clear()  # each cause warns once per process; each test starts anew
    yield
    store_module._warned.clear()


def _reopen(store: Store) -> Store:
    store.close()  # checkpoints the WAL into the database file
    return Store(store.directory, max_bytes=store.max_bytes)


# A child process that loads keraunos/persist/store.py alone (standard library only: no torch import).
CHILD = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("keraunos_store", sys.argv[1])
    store_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(store_module)
    directory, mode, name = sys.argv[2], sys.argv[3], sys.argv[4]
    store = store_module.Store(directory)
    bad = 0
    if mode == "race":
        sys.stdin.readline()  # both children start writing at once
        for i in range(200):
            store.put("ns", "shared", f"{name}:{i}:".encode() * 500)
            store.put("ns", f"{name}-{i}", f"{name}-{i}".encode() * 50)
            value = store.get("ns", "shared")
            parts = value.decode().split(":") if value is not None else ["x", "0"]
            if value is not None and value != f"{parts[0]}:{parts[1]}:".encode() * 500:
                bad += 1
        print("bad", bad)
    else:  # write until killed
        i = 0
        while True:
            store.put("ns", f"k{i}", f"value {i} ".encode() * 400)
            if i == 20:
                print("writing", flush=True)
            i += 1
""")


def _child(tmp_path, mode: str, name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, store_module.__file__, str(tmp_path),
                             mode, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def test_a_value_put_is_the_value_got(tmp_path):
    store = Store(tmp_path)
    store.put("programs", "key", b"\x00compiled\xff")
    assert store.get("programs", "key") == b"\x00compiled\xff"
    assert store.get("other", "key") is None
    assert _reopen(store).get("programs", "key") == b"\x00compiled\xff"


def test_put_replaces_the_value(tmp_path):
    store = Store(tmp_path)
    store.put("ns", "key", b"first")
    store.put("ns", "key", b"second, longer")
    assert store.get("ns", "key") == b"second, longer"
    assert store.info() == {"entries": 1, "bytes": 14, "path": str(tmp_path / "store.sqlite3"),
                            "limit": store.max_bytes, "error": None}


def test_past_the_limit_the_least_recently_read_entry_goes_first(tmp_path):
    store = Store(tmp_path, max_bytes=30)
    for key in "abc":
        store.put("ns", key, key.encode() * 10)
    assert store.get("ns", "a") == b"a" * 10  # now b is the least recently used
    store.put("ns", "d", b"d" * 10)
    assert [store.get("ns", key) for key in "abcd"] == [b"a" * 10, None, b"c" * 10, b"d" * 10]
    assert store.info()["bytes"] == 30


def test_a_value_larger_than_the_limit_is_not_stored(tmp_path):
    store = Store(tmp_path, max_bytes=8)
    store.put("ns", "small", b"1234")
    store.put("ns", "big", b"123456789")
    assert (store.get("ns", "small"), store.get("ns", "big")) == (b"1234", None)


def test_the_limit_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAUNOS_STORE_MAX_BYTES", "123")
    assert Store(tmp_path).info()["limit"] == 123


def test_the_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KERAUNOS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_directory() == tmp_path / "xdg" / "keraunos"
    monkeypatch.setenv("KERAUNOS_CACHE_DIR", str(tmp_path / "mine"))
    assert default_directory() == tmp_path / "mine"
    assert Store().path == tmp_path / "mine" / "store.sqlite3"


def test_a_value_that_fails_its_checksum_reads_as_absent_and_is_dropped(tmp_path):
    store = Store(tmp_path)
    store.put("ns", "key", b"the real value")
    store.put("ns", "other", b"untouched")
    store.close()
    with sqlite3.connect(tmp_path / "store.sqlite3") as db:
        db.execute("UPDATE entries SET value = ? WHERE key = 'key'", (b"the fake value",))
    with pytest.warns(RuntimeWarning, match="checksum"):
        assert store.get("ns", "key") is None
    assert store.get("ns", "other") == b"untouched"
    store.close()
    with sqlite3.connect(tmp_path / "store.sqlite3") as db:
        assert db.execute("SELECT key FROM entries").fetchall() == [("other",)]


def test_random_bytes_over_the_database_read_as_empty_then_a_new_store_works(tmp_path):
    store = Store(tmp_path)
    store.put("ns", "key", b"value")
    store.close()
    path = tmp_path / "store.sqlite3"
    path.write_bytes(os.urandom(path.stat().st_size))
    with pytest.warns(RuntimeWarning) as caught:
        assert store.get("ns", "key") is None
        store.put("ns", "key", b"ignored or stored, never raised")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert str(path) in message and "keraunos cache clear" in message
    assert "KERAUNOS_CACHE_DIR" in message
    assert len(list(tmp_path.glob("store.sqlite3*.corrupt"))) == 1
    store.put("ns", "key", b"fresh")
    assert store.get("ns", "key") == b"fresh"
    assert _reopen(store).get("ns", "key") == b"fresh"


def test_a_truncated_database_reads_each_value_right_or_not_at_all(tmp_path):
    store = Store(tmp_path)
    values = {f"k{i}": f"value {i} ".encode() * 300 for i in range(40)}
    for key, value in values.items():
        store.put("ns", key, value)
    store.close()
    path = tmp_path / "store.sqlite3"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        got = {key: store.get("ns", key) for key in values}
    assert all(got[key] in (None, values[key]) for key in values)
    assert None in got.values()
    store.put("ns", "after", b"works")
    assert store.get("ns", "after") == b"works"


def test_a_read_only_directory_reads_as_empty(tmp_path):
    directory = tmp_path / "ro"
    Store(directory).put("ns", "key", b"value")
    directory.chmod(0o500)
    try:
        if os.access(directory, os.W_OK):
            pytest.skip("running as root: chmod does not make the directory read-only")
        fresh = Store(directory)
        with pytest.warns(RuntimeWarning, match="KERAUNOS_CACHE_DIR"):
            assert fresh.get("ns", "key") in (None, b"value")
            fresh.put("ns", "new", b"value")
        assert fresh.get("ns", "new") is None
    finally:
        directory.chmod(0o700)


def test_a_directory_that_cannot_be_made_reads_as_empty_and_warns_once(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    store = Store(tmp_path / "a_file" / "store")
    with pytest.warns(RuntimeWarning) as caught:
        store.put("ns", "key", b"value")
        store.put("ns", "key", b"value")
        assert store.get("ns", "key") is None
    assert len(caught) == 1 and "cannot be created or written" in str(caught[0].message)


def test_a_full_disk_stores_nothing_new_and_keeps_what_it_had(tmp_path):
    store = Store(tmp_path)
    store.put("ns", "old", b"kept")
    pages = store._connect().execute("PRAGMA page_count").fetchone()[0]
    store._connect().execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
    with pytest.warns(RuntimeWarning, match="full"):
        store.put("ns", "new", os.urandom(50_000))
    assert (store.get("ns", "old"), store.get("ns", "new")) == (b"kept", None)


def test_a_lock_held_past_the_timeout_skips_the_write(tmp_path):
    store = Store(tmp_path, timeout=0.05)
    store.put("ns", "key", b"old")
    other = sqlite3.connect(tmp_path / "store.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process is writing, and takes its time
    try:
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="lock"):
            store.put("ns", "key", b"new")
        assert time.perf_counter() - start < 2
        assert store.get("ns", "key") == b"old"  # WAL: readers still read
    finally:
        other.execute("ROLLBACK")
        other.close()
    store.put("ns", "key", b"new")
    assert store.get("ns", "key") == b"new"


def test_two_processes_writing_at_once_read_back_whole_values(tmp_path):
    Store(tmp_path).put("ns", "shared", b"p0:0:" * 500)  # the database exists before the race
    children = [_child(tmp_path, "race", name) for name in ("p1", "p2")]
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    outputs = [child.communicate(timeout=60)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert outputs == ["bad 0\n", "bad 0\n"]
    store = Store(tmp_path)
    assert store.get("ns", "shared") in {f"{p}:{i}:".encode() * 500
                                         for p in ("p1", "p2") for i in range(200)}
    for name in ("p1", "p2"):
        assert [store.get("ns", f"{name}-{i}") for i in range(200)] == \
            [f"{name}-{i}".encode() * 50 for i in range(200)]


def test_a_process_killed_in_the_middle_of_writing_leaves_a_working_store(tmp_path):
    child = _child(tmp_path, "kill", "writer")
    try:
        assert child.stdout.readline() == "writing\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        child.stdin.close()
    store = Store(tmp_path)
    got = [store.get("ns", f"k{i}") for i in range(store.info()["entries"] + 5)]
    assert got[:21] == [f"value {i} ".encode() * 400 for i in range(21)]
    assert all(value in (None, f"value {i} ".encode() * 400) for i, value in enumerate(got))
    store.put("ns", "after", b"works")
    assert store.get("ns", "after") == b"works"


def test_clear_removes_even_a_corrupted_database(tmp_path):
    store = Store(tmp_path)
    store.put("ns", "key", b"value")
    store.close()
    (tmp_path / "store.sqlite3").write_bytes(b"garbage" * 1000)
    assert store.clear()
    assert store.info()["entries"] == 0
    store.put("ns", "key", b"again")
    assert store.get("ns", "key") == b"again"


def test_cache_info_and_clear_on_the_command_line(tmp_path, monkeypatch, capsys):
    from keraunos.cli import main
    monkeypatch.setenv("KERAUNOS_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("KERAUNOS_STORE_MAX_BYTES", "4096")
    store = Store()
    store.put("ns", "a", b"x" * 1000)
    store.put("ns", "b", b"y" * 1000)
    (tmp_path / "inductor" / "cpp").mkdir(parents=True)
    (tmp_path / "inductor" / "cpp" / "kernel.so").write_bytes(b"\x7fELF" * 512)

    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"keraunos store:        {tmp_path / 'store'}\n" in out
    assert "entries:             2\n" in out
    assert "size:                2.0 KiB of 4.0 KiB" in out
    assert f"Inductor kernel cache: {tmp_path / 'inductor'} (2.0 KiB;" in out

    assert main(["cache", "clear"]) == 0
    assert store.get("ns", "a") is None and store.info()["entries"] == 0
    assert (tmp_path / "inductor" / "cpp" / "kernel.so").exists()
    assert main(["cache", "clear", "--kernels"]) == 0
    assert not (tmp_path / "inductor").exists()
    assert "removed Inductor's kernel cache" in capsys.readouterr().out
