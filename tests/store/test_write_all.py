"""layout.write_all: every byte, at most WRITE_CHUNK bytes per write(2) call."""

from __future__ import annotations

import array
import os

from sparkcache.store import layout


def test_write_all_writes_every_byte_in_bounded_calls(tmp_path, monkeypatch):
    sizes: list[int] = []
    real_write = os.write

    def recording_write(fd, data):
        sizes.append(len(data))
        return real_write(fd, data)

    data = os.urandom(5 * layout.WRITE_CHUNK + 3)
    monkeypatch.setattr(layout.os, "write", recording_write)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        layout.write_all(fd, data)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert max(sizes) <= layout.WRITE_CHUNK and len(sizes) == 6


def test_write_all_counts_bytes_not_items(tmp_path):
    words = array.array("I", range(300_000))  # 1.2 MB in 4-byte items
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        layout.write_all(fd, memoryview(words))
    finally:
        os.close(fd)
    assert path.read_bytes() == words.tobytes()
