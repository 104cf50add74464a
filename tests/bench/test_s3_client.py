"""bench/s3_client.py runs end to end (obstore only: boto3 is installed apart for the bench, see its
docstring) and records what the client choice rests on: the conditional PUT refused with a 412
and the first bytes kept, a rate and the client's CPU per GiB for each pass."""

from __future__ import annotations

import json

from bench import s3_client


def test_the_bench_records_the_conditional_put_and_each_pass(tmp_path):
    assert s3_client.main(["--out", str(tmp_path), "--clients", "obstore", "--count", "2", "--threads", "1", "2",
                           "--sizes", "64KiB"]) == 0
    result = json.loads((tmp_path / "s3_client.json").read_text())
    obstore = result["clients"]["obstore"]
    assert obstore["conditional_put"]["second_put_refused_with_412"], obstore["conditional_put"]
    assert obstore["conditional_put"]["first_bytes_kept"] and "AlreadyExistsError" in obstore["conditional_put"]["error"]
    assert [(p["size"], p["threads"]) for p in obstore["passes"]] == [(64 << 10, 1), (64 << 10, 2)]
    assert all(p[op]["MiBps"] > 0 and p[op]["cpu_s_per_GiB"] >= 0 for p in obstore["passes"] for op in ("put", "get"))
    assert [p.name for p in tmp_path.iterdir()] == ["s3_client.json"]  # the server's directory went with it
