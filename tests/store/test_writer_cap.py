"""Every writer of one root uses one cap: two writers with different ``max_bytes`` or low
watermarks would each evict toward their own, and the smaller would silently win. A writer
whose cap differs from the one the live writers recorded is refused, naming both, the file
and the fix; with no other writer alive a new cap replaces the old (how an operator changes
it); readers are never refused. The other writers are real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from sparkcache.settings import SettingsError
from sparkcache.store import PageStore
from store_helpers import REPO_ROOT, open_store, run_cli

GiB, MiB = 1 << 30, 1 << 20


@contextlib.contextmanager
def writer_process(root, max_bytes: int, low: int):
    """Another process holding a writer of ``root`` open with this cap until the block ends."""
    code = ("import sys\n"
            "from sparkcache.store import PageStore\n"
            f"store = PageStore({str(root)!r}, max_bytes={max_bytes}, low_watermark_bytes={low})\n"
            "print('open', flush=True)\n"
            "sys.stdin.read()\n")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line == "open", proc.stderr.read()
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
        proc.wait(timeout=30)


def _cap_file(root) -> str:
    return os.path.join(str(root), "default", "locks", "cap.json")


def _recorded(root) -> dict:
    with open(_cap_file(root)) as f:
        return json.load(f)


def test_a_writer_with_another_cap_is_refused_naming_both_the_file_and_the_fix(tmp_path):
    root = tmp_path / "s"
    with writer_process(root, 2 * GiB, 1 * GiB):
        with pytest.raises(SettingsError) as info:
            PageStore(str(root), max_bytes=4 * GiB, low_watermark_bytes=1 * GiB)
        message = str(info.value)
        for needle in ("SPARKCACHE_MAX_BYTES=4GiB", "SPARKCACHE_MAX_BYTES=2GiB", _cap_file(root),
                       "SPARKCACHE_NAMESPACE", "same SPARKCACHE_MAX_BYTES"):
            assert needle in message, (needle, message)
        with pytest.raises(SettingsError, match="SPARKCACHE_LOW_WATERMARK_BYTES=512MiB"):
            PageStore(str(root), max_bytes=2 * GiB, low_watermark_bytes=512 * MiB)
        # the same cap opens; a reader with any cap is never refused
        PageStore(str(root), max_bytes=2 * GiB, low_watermark_bytes=1 * GiB).close()
        reader = PageStore(str(root), max_bytes=8 * GiB, low_watermark_bytes=1 * GiB, read_only=True)
        assert reader.max_bytes == 8 * GiB
        # another namespace of the same root is another store
        PageStore(str(root), namespace="other", max_bytes=4 * GiB, low_watermark_bytes=1 * GiB).close()
    assert _recorded(root)["max_bytes"] == 2 * GiB


def test_with_no_writer_alive_a_new_cap_replaces_the_old(tmp_path):
    root = tmp_path / "s"
    with writer_process(root, 2 * GiB, 1 * GiB):
        pass
    # the operator's change: every writer stopped, then started with the new cap
    with writer_process(root, 4 * GiB, 3 * GiB):
        assert _recorded(root)["max_bytes"] == 4 * GiB
        with pytest.raises(SettingsError, match="SPARKCACHE_MAX_BYTES=2GiB"):
            PageStore(str(root), max_bytes=2 * GiB, low_watermark_bytes=1 * GiB)


def test_a_killed_writer_leaves_no_claim(tmp_path):
    root = tmp_path / "s"
    with writer_process(root, 2 * GiB, 1 * GiB) as proc:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        store = PageStore(str(root), max_bytes=4 * GiB, low_watermark_bytes=1 * GiB)
    assert _recorded(root)["max_bytes"] == 4 * GiB
    store.close()


def test_writers_in_one_process_agree_too_until_one_is_closed(tmp_path):
    first = open_store(tmp_path / "s", max_bytes=2 * GiB, low_watermark_bytes=1 * GiB)
    with pytest.raises(SettingsError):
        open_store(tmp_path / "s", max_bytes=4 * GiB, low_watermark_bytes=1 * GiB)
    first.close()
    open_store(tmp_path / "s", max_bytes=4 * GiB, low_watermark_bytes=1 * GiB).close()


@pytest.mark.parametrize("damage", [b"", b"{not json", b"[1, 2]", b'{"max_bytes": "2GiB"}',
                                    b'{"max_bytes": true, "low_watermark_bytes": 0}'])
def test_a_damaged_record_is_refused_while_a_writer_lives_and_replaced_when_none_does(tmp_path, damage):
    root = tmp_path / "s"
    with writer_process(root, 2 * GiB, 1 * GiB):
        with open(_cap_file(root), "wb") as f:
            f.write(damage)
        with pytest.raises(SettingsError) as info:
            PageStore(str(root), max_bytes=2 * GiB, low_watermark_bytes=1 * GiB)
        message = str(info.value)
        assert _cap_file(root) in message and "damaged" in message and "stop every writer" in message
    store = PageStore(str(root), max_bytes=2 * GiB, low_watermark_bytes=1 * GiB)
    assert _recorded(root)["max_bytes"] == 2 * GiB
    store.close()


def test_a_leftover_temporary_record_is_harmless(tmp_path):
    root = tmp_path / "s"
    open_store(root, max_bytes=2 * GiB, low_watermark_bytes=1 * GiB).close()
    with open(_cap_file(root) + ".tmp", "wb") as f:
        f.write(b"half a reco")  # a crash between write and rename
    open_store(root, max_bytes=2 * GiB, low_watermark_bytes=1 * GiB).close()
    assert _recorded(root)["max_bytes"] == 2 * GiB


def test_gc_with_another_cap_than_the_serving_writers_is_refused(tmp_path):
    root = tmp_path / "s"
    with writer_process(root, 2 * GiB, 1 * GiB):
        cli = run_cli("gc", "--root", str(root))  # the defaults: 40GiB
        assert cli.returncode == 2, (cli.returncode, cli.stdout, cli.stderr)
        assert "SPARKCACHE_MAX_BYTES=2GiB" in cli.stderr and "SPARKCACHE_MAX_BYTES=40GiB" in cli.stderr
        cli = run_cli("gc", "--root", str(root), env={"SPARKCACHE_MAX_BYTES": "2GiB",
                                                        "SPARKCACHE_LOW_WATERMARK_BYTES": "1GiB"})
        assert cli.returncode == 0, cli.stderr
        assert run_cli("status", "--root", str(root)).returncode == 0  # a reader
