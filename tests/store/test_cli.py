"""The ``sparkcache`` command, run as ``python -m sparkcache`` in a subprocess."""

import json
import os
import re

import pytest

from sparkcache.store import PassBudget  # noqa: F401  (import check: no vLLM/torch needed)
from hostile_helpers import stopped_lock_holder
from store_helpers import IDENT, conv_keys, conv_pages, open_store, run_cli


def _store(tmp_path, n_convs=3):
    store = open_store(tmp_path / "s", page_blocks=4)
    for conv in range(n_convs):
        store.publish(IDENT, conv_keys(conv, 10), conv_pages(conv, 10, 4))
    return store


def test_status_prints_capacity_line_and_gauges(tmp_path):
    _store(tmp_path)
    cli = run_cli("status", "--root", str(tmp_path / "s"), env={"SPARKCACHE_MAX_BYTES": "2GiB",
                                                                "SPARKCACHE_LOW_WATERMARK_BYTES": "1GiB"})
    assert cli.returncode == 0, cli.stderr
    first = cli.stdout.splitlines()[0]
    assert re.fullmatch(r"sparkcache: capacity ranks=1 entries=3 used=0\.0/2\.0GiB healthy=yes", first), first
    # the gauges an opened store tells, under the names vLLM's /metrics exports
    for gauge in ("vllm:sparkcache_capacity_used_bytes", "vllm:sparkcache_capacity_limit_bytes",
                  "vllm:sparkcache_entries", "vllm:sparkcache_filesystem_free_bytes",
                  "vllm:sparkcache_filesystem_floor_bytes"):
        assert f"# TYPE {gauge} gauge" in cli.stdout, gauge
    assert 'vllm:sparkcache_entries{rank="0"} 3.0' in cli.stdout
    assert 'vllm:sparkcache_capacity_limit_bytes{rank="0"} 2.147483648e+09' in cli.stdout
    # a serving worker's gauges (capture slots, maintenance passes) are not the CLI's to print
    assert "pending_slots" not in cli.stdout and "maintenance_" not in cli.stdout


def test_status_several_ranks(tmp_path):
    _store(tmp_path)
    other = open_store(tmp_path / "s2", page_blocks=4)
    other.publish(IDENT, conv_keys(9, 4), conv_pages(9, 4, 4))
    cli = run_cli("status", "--root", str(tmp_path / "s"), "--root", str(tmp_path / "s2"))
    assert cli.stdout.startswith("sparkcache: capacity ranks=2 entries=4 used=0.0/80.0GiB healthy=yes")
    assert 'vllm:sparkcache_entries{rank="0"} 3.0' in cli.stdout  # one rank label per --root, in order
    assert 'vllm:sparkcache_entries{rank="1"} 1.0' in cli.stdout


def test_status_applies_settings_validation(tmp_path):
    _store(tmp_path)
    cli = run_cli("status", "--root", str(tmp_path / "s"), env={"SPARKCACHE_MAX_BYTES": "lots"})
    assert cli.returncode == 2
    assert "SPARKCACHE_MAX_BYTES='lots'" in cli.stderr and "GiB" in cli.stderr
    cli = run_cli("status", "--root", str(tmp_path / "s"), "--config",
                  json.dumps({"max_bytes": "1GiB", "low_watermark_bytes": "2GiB"}))
    assert cli.returncode == 2 and "SPARKCACHE_LOW_WATERMARK_BYTES" in cli.stderr
    cli = run_cli("status", "--root", str(tmp_path / "missing"))
    assert cli.returncode == 2 and "no store at" in cli.stderr


def test_verify_ok_and_failing(tmp_path):
    store = _store(tmp_path)
    assert run_cli("verify", "--root", str(tmp_path / "s")).returncode == 0
    handle = store.lookup(IDENT, conv_keys(1, 10)).handle
    victim = store.objects.path(handle.pages[0].digest)
    with open(victim, "r+b") as f:
        f.write(b"X")
    cli = run_cli("verify", "--root", str(tmp_path / "s"))
    assert cli.returncode == 1
    line = next(l for l in cli.stdout.splitlines() if l.startswith("BAD"))
    assert victim in line and handle.entry_id in line and "corrupt" in line


def test_gc_runs_one_bounded_pass(tmp_path):
    _store(tmp_path, n_convs=6).close()  # every writer of a root uses one cap: this one leaves
    cli = run_cli("gc", "--root", str(tmp_path / "s"), "--config",
                  json.dumps({"max_bytes": "1MiB", "low_watermark_bytes": 0,
                              "maintenance_max_entries": 2}))
    assert cli.returncode == 0, cli.stderr
    # under max: nothing to evict
    assert "evicted=0" in cli.stdout and "stopped_by=done" in cli.stdout
    store = open_store(tmp_path / "s", max_bytes=1 << 20, low_watermark_bytes=512 << 10)
    for conv in range(6, 80):  # push it over 1 MiB
        store.publish(IDENT, conv_keys(conv, 10), conv_pages(conv, 10, 4))
    cli = run_cli("gc", "--root", str(tmp_path / "s"), "--config",
                  json.dumps({"max_bytes": "1MiB", "low_watermark_bytes": "512KiB",
                              "maintenance_max_entries": 2}))
    assert cli.returncode == 0, cli.stderr
    assert "evicted=2 " in cli.stdout and "stopped_by=entries" in cli.stdout
    assert re.search(r"remaining_entries=[1-9]", cli.stdout), cli.stdout


def test_gc_exits_3_when_another_process_holds_the_lock(tmp_path):
    """A pass that never got the store's lock did not do its job: exit 3 (busy), a line that
    says why and what to do; the pass's report is still printed."""
    store = _store(tmp_path)
    store.close()  # the gc below is the store's one writer (its cap is the settings' default)
    with stopped_lock_holder(store.layout.gc_lock_path):
        cli = run_cli("gc", "--root", str(tmp_path / "s"))
    assert cli.returncode == 3, (cli.returncode, cli.stdout, cli.stderr)
    assert "stopped_by=lock" in cli.stdout
    last = cli.stderr.strip().splitlines()[-1]
    assert last.startswith("sparkcache gc:") and "lock" in last, last
    assert "again" in last and f"fuser {store.layout.gc_lock_path}" in last, last


def test_gc_exits_1_when_its_pass_stopped_on_an_error(tmp_path):
    store = _store(tmp_path)
    store.close()
    os.unlink(store.layout.gc_lock_path) if os.path.lexists(store.layout.gc_lock_path) else None
    os.mkdir(store.layout.gc_lock_path)  # a directory where the lock file belongs
    cli = run_cli("gc", "--root", str(tmp_path / "s"))
    assert cli.returncode == 1, (cli.returncode, cli.stdout, cli.stderr)
    assert "stopped_by=error" in cli.stdout
    last = cli.stderr.strip().splitlines()[-1]
    assert last.startswith("sparkcache gc:") and store.layout.gc_lock_path in last, last
    assert "sparkcache verify" in last and "again" in last, last


@pytest.mark.parametrize("cmd", ["status", "inspect"])
def test_a_command_that_cannot_list_the_manifests_exits_1(tmp_path, cmd):
    """status counted zero entries and said healthy=yes with a file in place of manifests/."""
    store = _store(tmp_path)
    import shutil
    shutil.rmtree(store.layout.manifests_dir)
    with open(store.layout.manifests_dir, "w") as f:
        f.write("not a directory")
    cli = run_cli(cmd, "--root", str(tmp_path / "s"), *SUBCOMMANDS[cmd])
    assert cli.returncode == 1, (cli.returncode, cli.stdout, cli.stderr)
    assert "healthy=yes" not in cli.stdout
    line = cli.stderr.strip().splitlines()[-1]
    assert store.layout.manifests_dir in line and "sparkcache verify" in line, line


def test_inspect_of_no_entry_says_so(tmp_path):
    _store(tmp_path)
    cli = run_cli("inspect", "--root", str(tmp_path / "s"), "ffffffff")
    assert cli.returncode == 1
    assert "no entry" in cli.stderr and "longer prefix" not in cli.stderr, cli.stderr


def test_the_help_documents_the_exit_codes():
    top = run_cli("--help")
    assert "Exit codes" in top.stdout, top.stdout
    for code, words in (("0", "did its job"), ("1", "failed"), ("2", "usage"), ("3", "busy")):
        assert re.search(rf"^\s+{code}\s+.*{words}", top.stdout, re.M), (code, top.stdout)
    for cmd in ("status", "verify", "gc", "inspect"):
        assert "exit" in run_cli(cmd, "--help").stdout.lower(), cmd


def test_inspect_entry(tmp_path):
    store = _store(tmp_path)
    entry_id = store.lookup(IDENT, conv_keys(2, 10)).entry_id
    cli = run_cli("inspect", "--root", str(tmp_path / "s"), entry_id[:10], "--verify")
    assert cli.returncode == 0, cli.stderr
    assert f"entry {entry_id}" in cli.stdout and "identity.model = tiny-llama" in cli.stdout
    assert "blocks     10 (160 tokens), 4 blocks/page, 3 pages" in cli.stdout
    assert cli.stdout.count("verified") == 3
    assert run_cli("inspect", "--root", str(tmp_path / "s"), "ffffffff").returncode == 1


def test_every_subcommand_has_help():
    top = run_cli("--help")
    assert top.returncode == 0 and "SPARKCACHE_MAX_BYTES" in top.stdout
    for cmd in ("status", "verify", "gc", "inspect"):
        cli = run_cli(cmd, "--help")
        assert cli.returncode == 0 and "--root" in cli.stdout and len(cli.stdout) > 200, cmd


def test_cli_does_not_import_vllm_or_torch(tmp_path):
    _store(tmp_path)
    import subprocess
    import sys
    from store_helpers import REPO_ROOT
    code = ("import sys; from sparkcache.cli import main; main(['status', '--root', %r]); "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'heavy import'"
            % str(tmp_path / "s"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")}
    env["PYTHONPATH"] = REPO_ROOT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- usage errors: exit 2, one line

# Each subcommand with the positional arguments it needs; the store root does not exist, so a
# usage error must be reported before the store is looked for (or imported).
SUBCOMMANDS = {"status": (), "verify": (), "gc": (), "inspect": ("abcdef",), "remote-check": ()}
# The capacity sweeper's commands need no local store (tests/store/test_remote_gc.py runs them on a bucket).
REMOTE_SUBCOMMANDS = ("remote-status", "remote-gc")


def _refused_in_one_line(cli, *needles: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr (no traceback, no usage block) naming needles."""
    assert cli.returncode == 2, (cli.returncode, cli.stdout, cli.stderr)
    assert "Traceback" not in cli.stderr and not cli.stdout, cli.stderr
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1, cli.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _config_arg(tmp_path, case: str) -> tuple[str, str]:
    """(--config value, what the message must name) for one bad --config."""
    if case == "missing":
        path = tmp_path / "missing.json"
    elif case == "directory":
        path = tmp_path / "a-directory"
        path.mkdir()
    elif case == "invalid_json":
        path = tmp_path / "bad.json"
        path.write_text('{"max_bytes": "40GiB",}')
    elif case == "not_an_object":
        path = tmp_path / "list.json"
        path.write_text('["max_bytes"]')
    elif case == "not_utf8":
        path = tmp_path / "binary.json"
        path.write_bytes(b"\xff\xfe{}")
    elif case == "no_file_name":
        return "@", "--config"
    elif case == "empty":
        return "", "--config"
    else:  # inline JSON that does not parse
        return '{"max_bytes": 40GiB}', "--config"
    return f"@{path}", str(path)


@pytest.mark.parametrize("cmd", list(SUBCOMMANDS))
@pytest.mark.parametrize("case", ["missing", "directory", "invalid_json", "not_an_object", "not_utf8",
                                  "no_file_name", "empty", "inline_invalid"])
def test_a_bad_config_is_one_line_naming_the_file(tmp_path, cmd, case):
    value, names = _config_arg(tmp_path, case)
    cli = run_cli(cmd, "--root", str(tmp_path / "no-store"), "--config", value, *SUBCOMMANDS[cmd])
    line = _refused_in_one_line(cli, names, "--config")
    assert "no store at" not in line  # the config is checked first


@pytest.mark.parametrize("value", ["-1", "-256", "257", "many", "1.5"])
def test_gc_sweep_shards_out_of_range_is_refused_naming_the_option(tmp_path, value):
    cli = run_cli("gc", "--root", str(tmp_path / "no-store"), "--sweep-shards", value)
    _refused_in_one_line(cli, "--sweep-shards", value)


@pytest.mark.parametrize("cmd", list(SUBCOMMANDS))
def test_argument_errors_of_every_subcommand_are_one_line(tmp_path, cmd):
    cli = run_cli(cmd, "--root", str(tmp_path / "no-store"), "--no-such-option", *SUBCOMMANDS[cmd])
    _refused_in_one_line(cli, "--no-such-option", f"sparkcache {cmd} --help")
    cli = run_cli(cmd, "--root", str(tmp_path / "no-store"), *SUBCOMMANDS[cmd], "--namespace", "")
    _refused_in_one_line(cli, "SPARKCACHE_NAMESPACE=''")


@pytest.mark.parametrize("cmd", REMOTE_SUBCOMMANDS)
def test_the_remote_commands_refuse_bad_usage_in_one_line(tmp_path, cmd):
    value, names = _config_arg(tmp_path, "invalid_json")
    _refused_in_one_line(run_cli(cmd, "--config", value), names, "--config")
    _refused_in_one_line(run_cli(cmd, "--no-such-option"), "--no-such-option", f"sparkcache {cmd} --help")
    _refused_in_one_line(run_cli(cmd), "SPARKCACHE_REMOTE_BUCKET=''", "set it")
    _refused_in_one_line(run_cli(cmd, env={"SPARKCACHE_REMOTE_BUCKET": "kv-pages", "SPARKCACHE_REMOTE_MAX_BYTES": "-1"}),
                         "SPARKCACHE_REMOTE_MAX_BYTES='-1'")
    assert "exit" in run_cli(cmd, "--help").stdout.lower()
    if cmd == "remote-gc":
        _refused_in_one_line(run_cli(cmd, "--max-requests", "0"), "--max-requests", "'0'")


def test_missing_or_unknown_command_and_missing_entry_are_one_line():
    _refused_in_one_line(run_cli(), "COMMAND", "sparkcache --help")
    _refused_in_one_line(run_cli("bogus"), "'bogus'", "status")
    _refused_in_one_line(run_cli("inspect"), "ENTRY", "sparkcache inspect --help")


def test_every_command_and_option_has_help_text():
    import argparse

    from sparkcache.cli import _parser

    top = _parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    assert set(helps) == set(sub.choices) == set(SUBCOMMANDS) | set(REMOTE_SUBCOMMANDS), helps
    for name, parser in sub.choices.items():
        assert helps[name] and parser.description, name
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        cli = run_cli(name, "--help")
        assert cli.returncode == 0 and parser.description.split()[0] in cli.stdout, name


def test_a_per_rank_root_template_is_refused_with_one_rank_named(tmp_path):
    cli = run_cli("status", "--root", str(tmp_path / "rank{rank}"))
    assert cli.returncode == 2
    assert f"give one rank's root, e.g. --root {tmp_path}/rank0" in cli.stderr
