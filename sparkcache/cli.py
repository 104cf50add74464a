"""The ``sparkcache`` command: status, verify, gc, inspect, remote-check; remote-status and
remote-gc for the shared tier's namespace (``remote_cli``).

Every subcommand validates settings exactly as the connector does (environment
``SPARKCACHE_*`` plus an optional ``--config`` JSON dict in kv_connector_extra_config form);
``--root`` and ``--namespace`` override the settings. A command that did not do its job exits
non-zero with a line on stderr saying why and what to do (``EXIT_CODES``, also in ``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence

from .settings import SettingsError, Settings, load_settings, render_settings_help

if TYPE_CHECKING:  # the commands import the store when they run (as _open does)
    from .store import PageStore

# Object shards of a store (two hex digits); ``gc --sweep-shards`` sweeps 0 .. all of them.
_OBJECT_SHARDS = 256

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUSY = 0, 1, 2, 3
EXIT_CODES = {
    EXIT_OK: "did its job (status printed the report, verify found nothing bad, gc's pass ran, "
             "inspect showed the entry)",
    EXIT_FAILED: "failed: verify or inspect --verify found bad files, remote-check a broken remote "
                 "entry, inspect found no such entry, "
                 "gc's pass stopped on a filesystem error, or the store could not be opened or "
                 "read (the line on stderr names the file and the fix); remote-gc or remote-status "
                 "could not list or read the remote namespace (nothing was deleted) or a request "
                 "failed mid-pass (the line on stderr names the key and the fix)",
    EXIT_USAGE: "bad usage or settings (an unknown option, a bad SPARKCACHE_* value, no store at "
                "the root)",
    EXIT_BUSY: "busy: another process held the store's lock past the wait bound (a serving "
               "writer's maintenance or publications, or a stopped process); run it again, and "
               "if it persists find the holder with `fuser ROOT/NAMESPACE/locks/gc.lock`",
}


def _render_exit_codes() -> str:
    return "Exit codes:\n" + "\n".join(
        textwrap.fill(words, 100, initial_indent=f"  {code}  ", subsequent_indent="     ")
        for code, words in EXIT_CODES.items())


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the argument and where the help is; exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _count(maximum: int) -> Callable[[str], int]:
    """An argparse type: a whole number 0 .. maximum (argparse names the option when refused)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not 0 <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number 0 .. {maximum}")
        return value

    return parse


def namespace_and_config(p: argparse.ArgumentParser, under: str) -> None:
    """The options every command has: ``--namespace`` (under ``under``) and ``--config``."""
    p.add_argument("--namespace", help=f"namespace under {under} (SPARKCACHE_NAMESPACE)")
    p.add_argument("--config", metavar="JSON",
                   help="settings as a JSON object, keys as in kv_connector_extra_config "
                        "(e.g. '{\"max_bytes\": \"40GiB\"}'), or @FILE to read it from a file")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sparkcache", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect and maintain a sparkcache page store.\n\n" + _render_exit_codes(),
        epilog=render_settings_help())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, many_roots: bool = False) -> None:
        p.add_argument("--root", action="append" if many_roots else "store", metavar="DIR",
                       help="store directory (SPARKCACHE_ROOT)" +
                            ("; repeat for several ranks" if many_roots else ""))
        namespace_and_config(p, "the root")

    p = sub.add_parser("status", help="capacity line and the store's gauges (Prometheus text)",
                       description="Print the one-line capacity report, then the gauges an "
                                   "opened store tells (capacity, entries, the filesystem's free "
                                   "bytes and floor) in Prometheus text format: the names vLLM's "
                                   "/metrics exports, with a rank label per --root in order. "
                                   "Exit 0 when it printed the report (read healthy=), 1 when a "
                                   "store cannot be read.")
    common(p, many_roots=True)
    p = sub.add_parser("verify", help="full integrity sweep; exit 1 on any bad file",
                       description="Decode every manifest and re-hash every referenced object. "
                                   "Names each bad file and the entries it breaks; exit 1 if any.")
    common(p)
    p = sub.add_parser("gc", help="run one bounded maintenance pass and report it",
                       description="One maintenance pass (TTL, eviction toward the low watermark "
                                   "when above max, orphan sweep) within the settings' budget. "
                                   "Exit 0 when the pass ran (stopped_by=done, or its budget: "
                                   "run it again for the rest), 3 when another process held the "
                                   "store's lock (stopped_by=lock), 1 when the filesystem stopped "
                                   "it (stopped_by=error) or part of the store could not be read, "
                                   "so nothing was evicted or deleted (stopped_by=unknown).")
    common(p)
    p.add_argument("--sweep-shards", type=_count(_OBJECT_SHARDS),
                   default=_OBJECT_SHARDS, metavar="N",
                   help=f"object shards to sweep for orphans, 0 .. {_OBJECT_SHARDS} (default all)")
    p = sub.add_parser("inspect", help="show one entry: identity, blocks, pages, pins",
                       description="Show one entry (full id or a unique prefix of it). Exit 1 "
                                   "when no entry or several match, its manifest is bad, or with "
                                   "--verify an object is.")
    common(p)
    p.add_argument("entry", metavar="ENTRY", help="entry id or a unique prefix of it")
    p.add_argument("--verify", action="store_true", help="also re-hash the entry's objects")
    p = sub.add_parser("remote-check", help="read every remote entry of the namespace back; exit 1 on "
                       "any broken one",
                       description="List every manifest of the namespace in the shared tier's bucket "
                                   "(SPARKCACHE_REMOTE_BUCKET, _ENDPOINT, _PREFIX), decode it and read "
                                   "every object it names back, verified. Names each broken entry; "
                                   "exit 1 if any, or when the bucket cannot be read.")
    common(p)
    from .remote_cli import add_remote_commands

    add_remote_commands(sub, lambda p: namespace_and_config(p, "SPARKCACHE_REMOTE_PREFIX"))
    return parser


_CONFIG_EXAMPLE = "'{\"max_bytes\": \"40GiB\"}'"


def _read_config(value: str) -> dict[str, object]:
    """``--config``: a JSON object, or ``@FILE`` holding one; a SettingsError names the fix."""
    where, text = "--config", value
    if value.startswith("@"):
        path = value[1:]
        where = f"--config @{path}"
        if not path:
            raise SettingsError(f"{where}: no file name after '@'; pass --config @FILE or the "
                                f"JSON object itself, e.g. {_CONFIG_EXAMPLE}")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SettingsError(f"{where}: cannot read {path!r} ({reason}); pass a readable "
                                f"UTF-8 file holding a JSON object, e.g. {_CONFIG_EXAMPLE}") from None
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{where}: not valid JSON ({exc}); pass a JSON object, "
                            f"e.g. {_CONFIG_EXAMPLE}") from None
    if not isinstance(extra, dict):
        raise SettingsError(f"{where}: a JSON {type(extra).__name__} is not a JSON object of "
                            f"settings; pass e.g. {_CONFIG_EXAMPLE}")
    return extra


def _settings(args: argparse.Namespace, root: str | None) -> Settings:
    extra = _read_config(args.config) if args.config is not None else {}
    if root:
        extra["root"] = os.path.abspath(root)
    if args.namespace is not None:
        extra["namespace"] = args.namespace
    settings = load_settings(extra_config=extra)
    if settings.per_rank_root:
        raise SettingsError(f"root {settings.root!r} (from --root, --config or SPARKCACHE_ROOT) "
                            "names one root per tensor-parallel rank; give one rank's root, e.g. "
                            f"--root {settings.for_rank(0).root}")
    base = os.path.join(settings.root, settings.namespace)
    if not os.path.isdir(base):
        raise SettingsError(f"SPARKCACHE_ROOT={settings.root!r}: no store at {base} "
                            "(check --root and --namespace)")
    return settings


def _open(settings: Settings, *, writer: bool) -> PageStore:
    """The store; only a ``writer`` (gc) may write under the root."""
    from .store import PageStore

    return PageStore.from_settings(settings, read_only=not writer)


def _require_manifests_listable(store: PageStore) -> None:
    """What status and inspect count is read from ``manifests/``: when that cannot be listed
    (a file or a link in its place) they could only report an empty store. Raises the
    store's ``UnsafePathError`` naming it and the fix (exit 1)."""
    store.layout.listdir(store.layout.manifests_dir)


def cmd_status(args: argparse.Namespace) -> int:
    every_settings = [_settings(args, root) for root in args.root or [None]]
    from .metrics import render_capacity_line, render_store_gauges, store_gauges

    snapshots, gauges = [], []
    for settings in every_settings:  # one --root per rank, in rank order
        store = _open(settings, writer=False)
        _require_manifests_listable(store)
        snapshots.append(store.capacity())
        gauges.append(store_gauges(store))
    print(render_capacity_line(snapshots))
    print(render_store_gauges(gauges), end="")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    settings = _settings(args, args.root)
    from .store import PageStore

    report = PageStore.verify_root(settings.root, settings.namespace)
    for problem in report.problems:
        broken = ", ".join(problem.entries) or "(no entry)"
        print(f"BAD {problem.kind}: {problem.path}: {problem.detail}; breaks entries: {broken}")
    print(f"verify: entries={report.entries_checked} objects={report.objects_checked} "
          f"bytes={report.bytes_checked} orphans={report.orphan_objects} "
          f"problems={len(report.problems)} -> {'ok' if report.ok else 'FAILED'}")
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    settings = _settings(args, args.root)
    from .store import PassBudget, run_pass
    from .store.pacing import LOCK_FRACTION

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
    if report.stopped_by == "lock":
        print(f"sparkcache gc: the pass stopped on the store's lock: another process held "
              f"{store.layout.gc_lock_path} longer than the pass waits for it "
              f"({report.budget_ms * LOCK_FRACTION:g} ms, {LOCK_FRACTION:.0%} of "
              "SPARKCACHE_MAINTENANCE_MAX_MS): a serving writer's maintenance or publications, "
              "or a stopped process. Run gc again (or with a larger budget, --config "
              "'{\"maintenance_max_ms\": 1000}'); if it keeps failing, find the holder with "
              f"`fuser {store.layout.gc_lock_path}`", file=sys.stderr)
        return EXIT_BUSY
    if report.stopped_by == "unknown":
        print(f"sparkcache gc: nothing was evicted or deleted: {report.error}", file=sys.stderr)
        return EXIT_FAILED
    if report.stopped_by == "error":
        print(f"sparkcache gc: the pass stopped on a filesystem error: {report.error}. Fix it "
              "(`sparkcache verify` lists the files the store refuses; dmesg shows a failing "
              "disk) and run gc again", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    settings = _settings(args, args.root)
    from .store import ObjectError

    store = _open(settings, writer=False)
    _require_manifests_listable(store)
    matches = [e for e in store.entries() if e.entry_id.startswith(args.entry)]
    bad = [b for b in store.bad_manifests() if b.entry_id.startswith(args.entry)]
    if bad and not matches:
        for b in bad:
            print(f"entry {b.entry_id}: BAD manifest {b.path}: {b.detail}")
        return 1
    if not matches:
        print(f"inspect: no entry's id starts with {args.entry!r} (list the entries with: ls "
              f"{store.layout.manifests_dir}/*/)", file=sys.stderr)
        return EXIT_FAILED
    if len(matches) > 1:
        print(f"inspect: {len(matches)} entries match {args.entry!r}; give a longer prefix "
              f"(list them with: ls {store.layout.manifests_dir}/*/)", file=sys.stderr)
        return EXIT_FAILED
    entry = matches[0]
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
    print(f"  pinned     {'yes' if store.pinned(m.entry_id) else 'no'}")
    if m.state is not None:
        print(f"  state      recurrent state after block {m.block_count}, {m.state.size} bytes")
    status = 0
    named = [(f"page {i:4d}", page) for i, page in enumerate(m.pages)]
    for label, page in named + ([("state    ", m.state)] if m.state is not None else []):
        state = "shared" if store.references(page.digest) > 1 else "own"
        if args.verify:
            try:
                store.check_verified(page)
                state += ", verified"
            except ObjectError as exc:
                state += f", BAD {exc.reason}: {exc.detail}"
                status = 1
        print(f"  {label}  {page.digest}  {page.size} bytes  ({state})")
    return status


def cmd_remote_check(args: argparse.Namespace) -> int:
    extra = _read_config(args.config) if args.config is not None else {}
    if args.root:
        extra["root"] = os.path.abspath(args.root)
    if args.namespace is not None:
        extra["namespace"] = args.namespace
    settings = load_settings(extra_config=extra)
    if not settings.remote_bucket:
        raise SettingsError("SPARKCACHE_REMOTE_BUCKET='': remote-check needs the shared tier's bucket; set it "
                            "(and SPARKCACHE_REMOTE_ENDPOINT, SPARKCACHE_REMOTE_PREFIX as the connector has them)")
    from .store.remote_bucket import RemoteBucket
    from .store.remote_check import remote_check
    from .store.s3_location import S3Location

    bucket = RemoteBucket(S3Location.from_settings(settings))
    try:
        report = remote_check(bucket, settings.namespace)
    finally:
        bucket.close()
    for fault in report.faults:
        print(f"BAD {fault.reason}: {fault.key}: {fault.detail}")
    print(f"remote-check: entries={report.entries} objects={report.objects} bytes={report.object_bytes} "
          f"dangling_pointers={report.dangling_pointers} faults={len(report.faults)} -> "
          f"{'ok' if report.clean else 'FAILED'}")
    return 0 if report.clean else 1


def _remote(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from . import remote_cli

        return getattr(remote_cli, name)(args, _read_config(args.config) if args.config is not None else {})

    return run


_COMMANDS = {"status": cmd_status, "verify": cmd_verify, "gc": cmd_gc, "inspect": cmd_inspect,
             "remote-check": cmd_remote_check, "remote-status": _remote("cmd_remote_status"),
             "remote-gc": _remote("cmd_remote_gc")}


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 prints escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the subcommand's parser, so the message points at its help
        (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return _COMMANDS[args.command](args)
    except SettingsError as exc:
        print(f"sparkcache: settings error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as exc:  # the store cannot be opened or read (a link, EIO, busy)
        from .store.locks import LockTimeout
        from .store.results import os_failure

        # an OSError with its fix; the store's other refusals (UnsafePathError) carry theirs
        detail = os_failure(exc)[1] if isinstance(exc, OSError) else str(exc)
        print(f"sparkcache {args.command}: {detail}", file=sys.stderr)
        return EXIT_BUSY if isinstance(exc, LockTimeout) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
