"""The raw read the restore benchmarks compare against: its destination is faulted in and out
of the CPU's caches, as a restore's KV blocks are, and what it reads is what the files hold."""

from __future__ import annotations

import os

from bench.page_cache import evict_cpu_caches, last_level_cache_bytes, read_rate, resident_fraction


def _files(tmp_path, sizes):
    paths = []
    for k, size in enumerate(sizes):
        path = tmp_path / f"f{k}"
        path.write_bytes(os.urandom(size))
        paths.append(str(path))
    return paths


def test_a_warm_read_counts_every_byte_and_also_reports_the_cache_hot_destination(tmp_path):
    paths = _files(tmp_path, [3 << 20, 1, (1 << 20) + 7])
    out = read_rate(paths, cold=False)
    assert out["bytes"] == (4 << 20) + 8
    assert out["seconds"] > 0 and out["gb_per_s"] > 0 and out["hot_destination_gb_per_s"] > 0
    assert resident_fraction(paths) == 1.0


def test_a_cold_read_counts_every_byte_and_has_no_hot_destination_figure(tmp_path):
    paths = _files(tmp_path, [2 << 20])
    out = read_rate(paths, cold=True)
    assert out["bytes"] == 2 << 20 and "hot_destination_gb_per_s" not in out


def test_the_last_level_cache_is_the_largest_size_sysfs_names(tmp_path):
    for name, size in [("index0", "48K"), ("index2", "2048K"), ("index3", "480M"), ("index4", "junk")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    (tmp_path / "index5").mkdir()  # no size file
    assert last_level_cache_bytes(tmp_path) == 480 << 20
    assert last_level_cache_bytes(tmp_path / "none") == 0


def test_this_machine_names_its_caches_and_they_can_be_flushed():
    assert last_level_cache_bytes() > 0, "sysfs names no CPU cache: evict_cpu_caches falls back to its floor"
    evict_cpu_caches()
    evict_cpu_caches()


def test_a_read_larger_than_the_buffer_cap_reuses_the_buffer_and_counts_every_byte(tmp_path, monkeypatch):
    import bench.page_cache as page_cache

    monkeypatch.setattr(page_cache, "BUFFER_CAP", 3 << 20)
    paths = _files(tmp_path, [2 << 20, 2 << 20, 3 << 20, 1])
    out = read_rate(paths, cold=False)
    assert out["bytes"] == (7 << 20) + 1 and out["seconds"] > 0


def test_a_file_larger_than_the_buffer_cap_is_refused_by_name(tmp_path, monkeypatch):
    import pytest

    import bench.page_cache as page_cache

    monkeypatch.setattr(page_cache, "BUFFER_CAP", 1 << 20)
    paths = _files(tmp_path, [(1 << 20) + 1])
    with pytest.raises(ValueError, match="f0: 1048577 bytes"):
        read_rate(paths, cold=True)
