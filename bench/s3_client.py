"""PUT and GET throughput of the S3 client libraries against SeaweedFS on loopback: what the
choice of the S3 backend's client rests on (docs/REMOTE.md).

    python -m bench.s3_client --out DIR [--clients obstore boto3] [--count 24] [--threads 1 4]
                              [--sizes 4MiB 16MiB] [--site DIR]

One ``weed mini`` (``testing.seaweedfs``) under DIR; for each object size and thread count,
each client in turn (so that what else runs on the machine hits both alike) PUTs ``--count``
objects of random bytes (one request each, no multipart, ``If-None-Match: *`` as the backend puts
them), GETs them back and compares them, then deletes them. Each pass reports MiB/s over its wall
time and the client process's CPU seconds per GiB moved (user + system; the server is another
process). Both clients run with their defaults otherwise. Before the passes, each client is
checked for a conditional PUT: a second ``If-None-Match: *`` PUT of a key must fail with the
server's 412 and leave the first bytes. Writes DIR/s3_client.json.

boto3's botocore needs python-dateutil < 3, and the CPU lock pins 4.0.0, so boto3 is installed
apart for this bench and put first on ``sys.path`` with ``--site``:

    pip install --no-deps --target /tmp/s3bench boto3==1.44.18 botocore==1.44.18 \\
        s3transfer==0.19.3 python-dateutil==2.9.0.post0 six==1.17.0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from sparkcache.settings import parse_bytes
from testing.seaweedfs import S3Endpoint, SeaweedFS


class ObstoreClient:
    name = "obstore"

    def __init__(self, endpoint: S3Endpoint, threads: int) -> None:
        import obstore
        from obstore.exceptions import AlreadyExistsError
        from obstore.store import S3Store

        self.obstore, self.conflict = obstore, AlreadyExistsError  # what obstore makes of a 412
        self.version = obstore.__version__
        self.store = S3Store(endpoint.bucket, endpoint=endpoint.url, region=endpoint.region,
                             access_key_id=endpoint.access_key, secret_access_key=endpoint.secret_key,
                             client_options={"allow_http": True, "timeout": timedelta(seconds=60)},
                             retry_config={"max_retries": 0})

    def is_412(self, exc: Exception) -> bool:
        return isinstance(exc, self.conflict) and "412 Precondition Failed" in str(exc)

    def put_new(self, key: str, data: bytes) -> None:
        self.obstore.put(self.store, key, data, mode="create", use_multipart=False)

    def get(self, key: str) -> bytes:
        return self.obstore.get(self.store, key).bytes()

    def delete(self, key: str) -> None:
        self.obstore.delete(self.store, key)


class Boto3Client:
    name = "boto3"

    def __init__(self, endpoint: S3Endpoint, threads: int) -> None:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import ClientError

        self.bucket, self.conflict = endpoint.bucket, ClientError
        self.version = boto3.__version__
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint.url, region_name=endpoint.region, aws_access_key_id=endpoint.access_key,
            aws_secret_access_key=endpoint.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          max_pool_connections=max(10, threads), read_timeout=60))

    def is_412(self, exc: Exception) -> bool:
        return isinstance(exc, self.conflict) and \
            exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412

    def put_new(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)


CLIENTS = {"obstore": ObstoreClient, "boto3": Boto3Client}


def conditional_put(client) -> dict:
    """A second ``If-None-Match: *`` PUT of a key: refused (412), the first bytes kept?"""
    key, first = f"bench/conditional/{secrets.token_hex(8)}", os.urandom(1024)
    client.put_new(key, first)
    try:
        client.put_new(key, os.urandom(1024))
        refused, error = False, ""
    except Exception as exc:  # noqa: BLE001 - which error it was is the result
        refused, error = client.is_412(exc), f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    kept = client.get(key) == first
    client.delete(key)
    return {"second_put_refused_with_412": refused, "first_bytes_kept": kept, "error": error}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_pass(client, size: int, count: int, threads: int) -> dict:
    base = os.urandom(size)
    datas = [i.to_bytes(8, "little") + base[8:] for i in range(count)]  # distinct, made before timing
    keys = [f"bench/{client.name}/{size}/{threads}/{secrets.token_hex(6)}-{i}" for i in range(count)]
    out = {"size": size, "count": count, "threads": threads}
    with ThreadPoolExecutor(threads) as pool:
        for op, fn in (("put", lambda i: client.put_new(keys[i], datas[i])),
                       ("get", lambda i: client.get(keys[i]) == datas[i])):
            cpu, t0 = cpu_seconds(), time.perf_counter()
            results = list(pool.map(fn, range(count)))
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu
            if op == "get" and not all(results):
                raise SystemExit(f"{client.name}: a GET returned other bytes than were put")
            moved = size * count
            out[op] = {"seconds": round(wall, 3), "MiBps": round(moved / wall / (1 << 20), 1),
                       "cpu_s_per_GiB": round(cpu / (moved / (1 << 30)), 2)}
        list(pool.map(client.delete, keys))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.s3_client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    p.add_argument("--sizes", nargs="+", default=["4MiB", "16MiB"])
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 4])
    p.add_argument("--site", help="a directory put first on sys.path (boto3 installed apart: see above)")
    args = p.parse_args(argv)
    if args.site:
        sys.path.insert(0, os.path.abspath(args.site))
    os.makedirs(args.out, exist_ok=True)
    results = {"command": "python -m bench.s3_client " + " ".join(argv if argv is not None else sys.argv[1:]),
               "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                        "loadavg_before": os.getloadavg()}, "clients": {}}
    with tempfile.TemporaryDirectory(dir=args.out, prefix="seaweedfs-") as where, SeaweedFS(where) as server:
        results["server"] = {"weed": server.weed, "command": " ".join(server.command())}
        made = {name: {t: CLIENTS[name](server.endpoint, t) for t in args.threads} for name in args.clients}
        for name, clients in made.items():
            results["clients"][name] = {"version": clients[args.threads[0]].version,
                                        "conditional_put": conditional_put(clients[args.threads[0]]), "passes": []}
        for size in map(parse_bytes, args.sizes):  # the clients take turns: what else runs hits both alike
            for threads in args.threads:
                for name, clients in made.items():
                    results["clients"][name]["passes"].append(one_pass(clients[threads], size, args.count, threads))
                    print(name, json.dumps(results["clients"][name]["passes"][-1]), flush=True)
    results["host"]["loadavg_after"] = os.getloadavg()
    path = os.path.join(args.out, "s3_client.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
