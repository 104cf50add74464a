"""The ``sparkcache`` command: status, verify, gc, inspect.

Every subcommand validates settings exactly as the connector does (environment
``SPARKCACHE_*`` plus an optional ``--config`` JSON dict in kv_connector_extra_config form);
``--root`` and ``--namespace`` override the settings. Exit codes: 0 fine, 1 a check failed
(``verify`` found bad files, ``inspect`` found no such entry), 2 bad usage or settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

from .settings import SettingsError, Settings, load_settings, render_settings_help


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkcache", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect and maintain a sparkcache page store.",
        epilog=render_settings_help())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, many_roots: bool = False) -> None:
        p.add_argument("--root", action="append" if many_roots else "store", metavar="DIR",
                       help="store directory (SPARKCACHE_ROOT)" +
                            ("; repeat for several ranks" if many_roots else ""))
        p.add_argument("--namespace", help="namespace under the root (SPARKCACHE_NAMESPACE)")
        p.add_argument("--config", metavar="JSON",
                       help="settings as a JSON object, keys as in kv_connector_extra_config "
                            "(e.g. '{\"max_bytes\": \"40GiB\"}'), or @FILE to read it from a file")

    p = sub.add_parser("status", help="capacity line and the store's gauges (Prometheus text)",
                       description="Print the one-line capacity report, then the gauges in "
                                   "Prometheus text format.")
    common(p, many_roots=True)
    p = sub.add_parser("verify", help="full integrity sweep; exit 1 on any bad file",
                       description="Decode every manifest and re-hash every referenced object. "
                                   "Names each bad file and the entries it breaks; exit 1 if any.")
    common(p)
    p = sub.add_parser("gc", help="run one bounded maintenance pass and report it",
                       description="One maintenance pass (TTL, eviction toward the low watermark "
                                   "when above max, orphan sweep) within the settings' budget.")
    common(p)
    p.add_argument("--sweep-shards", type=int, default=256, metavar="N",
                   help="object shards to sweep for orphans (of 256; default all)")
    p = sub.add_parser("inspect", help="show one entry: identity, blocks, pages, pins",
                       description="Show one entry (full id or a unique prefix of it).")
    common(p)
    p.add_argument("entry", metavar="ENTRY", help="entry id or a unique prefix of it")
    p.add_argument("--verify", action="store_true", help="also re-hash the entry's objects")
    return parser


def _settings(args: argparse.Namespace, root: str | None) -> Settings:
    extra: dict[str, Any] = {}
    if args.config:
        text = args.config
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        try:
            extra = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"--config: not a JSON object ({exc}); pass e.g. "
                                "'{\"max_bytes\": \"40GiB\"}'") from None
        if not isinstance(extra, dict):
            raise SettingsError("--config: must be a JSON object of settings")
    if root:
        extra["root"] = os.path.abspath(root)
    if args.namespace:
        extra["namespace"] = args.namespace
    settings = load_settings(extra_config=extra)
    base = os.path.join(settings.root, settings.namespace)
    if not os.path.isdir(base):
        raise SettingsError(f"SPARKCACHE_ROOT={settings.root!r}: no store at {base} "
                            "(check --root and --namespace)")
    return settings


def _open(settings: Settings, *, writer: bool, metrics: Any = None) -> Any:
    """The store; only a ``writer`` (gc) may write under the root."""
    from .store import PageStore

    return PageStore.from_settings(settings, metrics=metrics, read_only=not writer)


def cmd_status(args: argparse.Namespace) -> int:
    from .metrics import StoreMetrics, render_capacity_line

    snapshots, texts = [], []
    for rank, root in enumerate(args.root or [None]):
        metrics = StoreMetrics(rank=str(rank))
        store = _open(_settings(args, root), writer=False, metrics=metrics)
        snapshots.append(store.capacity())
        texts.append(metrics.render())
    print(render_capacity_line(snapshots))
    for text in texts:
        print(text, end="")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .store import verify_store
    from .store.layout import StoreLayout

    settings = _settings(args, args.root)
    report = verify_store(StoreLayout.create(settings.root, settings.namespace, make=False))
    for problem in report.problems:
        broken = ", ".join(problem.entries) or "(no entry)"
        print(f"BAD {problem.kind}: {problem.path}: {problem.detail}; breaks entries: {broken}")
    print(f"verify: entries={report.entries_checked} objects={report.objects_checked} "
          f"bytes={report.bytes_checked} orphans={report.orphan_objects} "
          f"problems={len(report.problems)} -> {'ok' if report.ok else 'FAILED'}")
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from .store import PassBudget, run_pass

    settings = _settings(args, args.root)
    store = _open(settings, writer=True)
    rec = store.last_recovery
    report = run_pass(store, PassBudget.from_settings(settings), sweep_shards=args.sweep_shards)
    print(f"gc: recovery removed {rec.stale_publications_removed} dead publication(s)")
    print(f"gc: pass took {report.duration_s * 1000:.1f} ms (budget {report.budget_ms:g} ms), "
          f"stopped_by={report.stopped_by}")
    print(f"gc: evicted={report.entries_evicted} expired={report.entries_expired} "
          f"orphans={report.orphans_collected} (swept {report.shards_swept}/{args.sweep_shards} shards) "
          f"reclaimed_bytes={report.bytes_reclaimed} "
          f"pinned_skipped={report.pinned_skipped} remaining_entries={report.remaining_entries} "
          f"deferred_objects={report.deferred_objects}")
    print(f"gc: used {report.used_bytes_before} -> {report.used_bytes_after} bytes "
          f"(max {report.max_bytes}, low watermark {report.low_watermark_bytes}), "
          f"entries={report.entries_after}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .store.objects import ObjectError
    from .store.pins import live_pins

    store = _open(_settings(args, args.root), writer=False)
    matches = [e for e in store.index.entries if e.startswith(args.entry)]
    bad = [b for e, b in store.index.bad.items() if e.startswith(args.entry)]
    if bad and not matches:
        for b in bad:
            print(f"entry {b.entry_id}: BAD manifest {b.path}: {b.detail}")
        return 1
    if len(matches) != 1:
        print(f"inspect: {len(matches)} entries match {args.entry!r}; give a longer prefix "
              "(list them with: ls ROOT/NAMESPACE/manifests/*/)", file=sys.stderr)
        return 1
    entry = store.index.entries[matches[0]]
    m = entry.manifest
    print(f"entry {m.entry_id}")
    print(f"  manifest   {entry.path} ({entry.manifest_bytes} bytes)")
    for key, value in m.identity.to_dict().items():
        print(f"  identity.{key} = {value}")
    print(f"  blocks     {m.block_count} ({m.block_count * m.identity.block_size} tokens), "
          f"{m.blocks_per_page} blocks/page, {len(m.pages)} pages, "
          f"{sum(p.size for p in m.pages)} bytes")
    print(f"  created    {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.created_at))}")
    print(f"  last used  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(entry.last_access))}")
    print(f"  pinned     {'yes' if m.entry_id in live_pins(store.layout.pins_dir) else 'no'}")
    status = 0
    for i, page in enumerate(m.pages):
        state = "shared" if store.index.refcount.get(page.digest, 0) > 1 else "own"
        if args.verify:
            try:
                store.objects.read_verified(page.digest, page.size)
                state += ", verified"
            except ObjectError as exc:
                state += f", BAD {exc.reason}: {exc.detail}"
                status = 1
        print(f"  page {i:4d}  {page.digest}  {page.size} bytes  ({state})")
    return status


_COMMANDS = {"status": cmd_status, "verify": cmd_verify, "gc": cmd_gc, "inspect": cmd_inspect}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except SettingsError as exc:
        print(f"sparkcache: settings error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
