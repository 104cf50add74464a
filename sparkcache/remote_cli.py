"""``python -m sparkcache remote-status`` and ``remote-gc``: the shared tier's namespace against its
bound (``SPARKCACHE_REMOTE_MAX_BYTES``), and one pass of the capacity sweeper
(``store/remote_sweeper.py``). Run remote-gc from one place per namespace (one cron job or
sidecar per bucket namespace, not every replica): docs/REMOTE.md, "Remote capacity".

Settings as every command reads them (environment, ``--config``, ``--namespace``); no local store
is needed. Exit 0 when the report was printed (remote-gc: its pass ran, ``stopped_by=done`` or
``budget``), 1 when the namespace could not be listed or read (nothing was deleted) or a request
failed mid-pass, 2 for bad usage or settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Callable

from .settings import Settings, load_settings

if TYPE_CHECKING:  # the commands import the store when they run
    from .store.remote_sweeper import SweepReport

_MAX_REQUESTS = 10_000  # remote-gc's default budget of DELETE and PUT requests per pass
_PROGRESS_EVERY = 1_000  # requests between two progress lines on stderr


def add_remote_commands(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The two commands, each given the options every command has by ``common``."""
    p = sub.add_parser("remote-status", help="the remote namespace's bytes against its bound, entries, oldest access",
                       description="List the shared tier's namespace (PREFIX/NAMESPACE/ of "
                                   "SPARKCACHE_REMOTE_BUCKET, every identity) and print its objects' "
                                   "bytes against SPARKCACHE_REMOTE_MAX_BYTES, its entries (and those whose "
                                   "objects are incomplete), the oldest and newest last access, and the "
                                   "objects no manifest references. Exit 0 when it printed the report, 1 "
                                   "when the namespace could not be listed or a manifest read.")
    common(p)
    p = sub.add_parser("remote-gc", help="one pass of the remote capacity sweeper (run from one place)",
                       description="One pass of the shared tier's capacity sweeper over the namespace: "
                                   "entries with missing objects, then the least recently accessed while "
                                   "over SPARKCACHE_REMOTE_MAX_BYTES, are evicted (pointers, manifest, "
                                   "access mark, then the objects no other entry names); objects no "
                                   "manifest references and older than SPARKCACHE_REMOTE_GC_GRACE_SECONDS "
                                   "go too. Run it from one place per namespace (a cron job or a sidecar, "
                                   "not every replica; docs/REMOTE.md). Exit 0 when the pass ran "
                                   "(stopped_by=done, or budget: run it again for the rest), 1 when the "
                                   "namespace could not be listed or a manifest read (stopped_by=unknown: "
                                   "nothing was deleted) or a request failed mid-pass (stopped_by=error: "
                                   "what was done is safe).")
    common(p)
    p.add_argument("--dry-run", action="store_true", help="plan and report the pass, delete nothing")
    p.add_argument("--max-requests", type=_positive, default=_MAX_REQUESTS, metavar="N",
                   help=f"DELETE and PUT requests one pass makes at most, an eviction begun being "
                        f"finished (default {_MAX_REQUESTS})")
    p.add_argument("--metrics-file", metavar="PATH",
                   help="also write the pass's vllm:sparkcache_remote_gc_* gauges there in Prometheus "
                        "text (for node_exporter's textfile collector), replaced whole; not with --dry-run")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _settings(args: argparse.Namespace, extra: dict[str, object]) -> Settings:
    if args.namespace is not None:
        extra["namespace"] = args.namespace
    return load_settings(extra_config=extra, require_root=False)


def _when(t: float | None) -> str:
    return "none" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def cmd_remote_status(args: argparse.Namespace, extra: dict[str, object]) -> int:
    settings = _settings(args, extra)
    from .store.remote_census import SweepRequests, summarize, take_census
    from .store.s3_location import S3Location

    bucket = SweepRequests(S3Location.from_settings(settings))
    try:
        census = take_census(bucket, settings.namespace)
    finally:
        bucket.close()
    where = bucket.location.where(census.namespace_prefix)
    if not census.complete:
        print(f"sparkcache remote-status: {where} could not be listed or read: {'; '.join(census.unknown)}",
              file=sys.stderr)
        return 1
    s = summarize(census, settings.remote_max_bytes, settings.remote_gc_grace_seconds, time.time())
    print(f"remote-status: {where}")
    print(f"remote-status: used_bytes={s.used_bytes} max_bytes={s.max_bytes} "
          f"over_bound={'yes' if s.over_bound else 'no'} entries={s.entries} "
          f"incomplete_entries={s.incomplete_entries} identities={s.identities}")
    print(f"remote-status: objects={s.objects} unreferenced_objects={s.unreferenced_objects} "
          f"unreferenced_bytes={s.unreferenced_bytes} young_unreferenced_objects={s.young_unreferenced_objects} "
          f"pointers={s.pointers} access_marks={s.access_marks}")
    print(f"remote-status: oldest_access={_when(s.oldest_access)} newest_access={_when(s.newest_access)}")
    return 0


def cmd_remote_gc(args: argparse.Namespace, extra: dict[str, object]) -> int:
    settings = _settings(args, extra)
    from .store.remote_sweeper import StoppedBy, SweepProgress, sweep
    from .store.s3_location import S3Location

    location = S3Location.from_settings(settings)
    last = [0]

    def progress(p: SweepProgress) -> None:
        if p.requests_done - last[0] >= _PROGRESS_EVERY:
            last[0] = p.requests_done
            print(f"remote-gc: progress {p.requests_done}/{p.requests_planned} requests, "
                  f"{p.entries_evicted} entries evicted, {p.bytes_freed} bytes freed", file=sys.stderr)

    r = sweep(location, settings.namespace, settings.remote_max_bytes, settings.remote_gc_grace_seconds,
              dry_run=args.dry_run, max_requests=args.max_requests, on_progress=progress)
    print(f"remote-gc: {location.where(f'{location.prefix}/{settings.namespace}/')} "
          f"{'dry run (nothing deleted)' if r.dry_run else 'pass'} stopped_by={r.stopped_by.value}")
    if args.metrics_file and not r.dry_run:
        _write_metrics(args.metrics_file, r, settings.namespace)
    if r.stopped_by is StoppedBy.UNKNOWN:
        print(f"sparkcache remote-gc: {r.error}; fix that and run remote-gc again", file=sys.stderr)
        return 1
    print(f"remote-gc: used_bytes {r.used_bytes_before} -> {r.used_bytes_after} (max_bytes {r.max_bytes}, "
          f"over_bound={'yes' if r.over_bound else 'no'}), entries {r.entries_before} -> {r.entries_after}")
    print(f"remote-gc: entries_evicted={r.entries_evicted} incomplete_entries={r.incomplete_entries} "
          f"objects_deleted={r.objects_deleted} orphans_deleted={r.orphans_deleted} bytes_freed={r.bytes_freed} "
          f"pointers_repointed={r.pointers_repointed} pointers_deleted={r.pointers_deleted} "
          f"pointers_restored={r.pointers_restored} "
          f"access_marks_deleted={r.access_marks_deleted}")
    print(f"remote-gc: young_unreferenced_objects={r.young_unreferenced_objects} "
          f"young_unreferenced_bytes={r.young_unreferenced_bytes} oldest_access={_when(r.oldest_access)} "
          f"requests_done={r.requests_done} requests_left={r.requests_left}")
    if r.stopped_by is StoppedBy.ERROR:
        print(f"sparkcache remote-gc: the pass stopped on a failed request: {r.error}. What it did is "
              "safe (no manifest names a deleted object); fix that and run remote-gc again", file=sys.stderr)
        return 1
    return 0


def _write_metrics(path: str, r: SweepReport, namespace: str) -> None:
    """The pass's gauges (``metrics.REMOTE_GC_GAUGES``) in Prometheus text at ``path``, replaced
    whole (a textfile collector never reads half of it); only ``ok`` and ``ended_at`` when the
    namespace could not be listed or read (its other numbers would be of part of it)."""
    from .metrics import render_remote_gc_gauges
    from .store.remote_sweeper import StoppedBy

    values = {"ok": float(r.ok), "ended_at": time.time()}
    if r.stopped_by is not StoppedBy.UNKNOWN:
        values.update(used_bytes_after=r.used_bytes_after, max_bytes=r.max_bytes, entries_after=r.entries_after,
                      entries_evicted=r.entries_evicted, incomplete_entries=r.incomplete_entries,
                      bytes_freed=r.bytes_freed, young_unreferenced_bytes=r.young_unreferenced_bytes,
                      oldest_access=r.oldest_access or 0.0, requests_left=r.requests_left)
    temp = f"{path}.tmp.{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as f:
        f.write(render_remote_gc_gauges(values, namespace))
    os.replace(temp, path)


__all__ = ["add_remote_commands", "cmd_remote_gc", "cmd_remote_status"]
