"""The one settings table of sparkcache.

Every setting is one row of ``SETTINGS_TABLE``: its name, type, default, environment
variable, allowed range and help. ``load_settings`` reads them, validates them and returns
a frozen ``Settings``; a bad value raises ``SettingsError`` naming the variable, the value
and the allowed range.

Sources and precedence (highest first):

1. ``extra_config``: vLLM's ``kv_connector_extra_config`` dict. Keys are the row's
   lower-case name without any prefix, e.g. ``{"max_bytes": "40GiB", "ttl_seconds": 0}``.
   Values may be strings (parsed like environment values) or already-typed values.
   The dict is shared with other components (for example the scheduler transforms'
   options), so keys that are not ours are left alone; a key that *looks like* one of
   ours (a close misspelling such as ``max_byte``) is an error, never silently ignored.
2. The environment: ``SPARKCACHE_<NAME>``, e.g. ``SPARKCACHE_MAX_BYTES=40GiB``.
3. The row's default.

Byte sizes accept a plain integer number of bytes or a number with a unit: binary
``KiB MiB GiB TiB`` (also ``Ki Mi Gi Ti``) or decimal ``KB MB GB TB``; ``1.5GiB`` is fine.
A bare ``G``/``M``/``K`` is refused as ambiguous.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import stat
import textwrap
from dataclasses import dataclass
from typing import Callable, Mapping

ENV_PREFIX = "SPARKCACHE_"
ACCESS_MODES = ("read-write", "restore-only", "store-only", "disabled")


class SettingsError(ValueError):
    """A setting has a bad value; the message names the variable, the value and the fix."""


# A parsed setting (the ``Settings`` field types; None: an option left unset). What is parsed
# is ``object``: an environment string or any JSON value from ``kv_connector_extra_config``,
# whose type each parser checks before using it.
SettingValue = bool | int | float | str | None


# ---------------------------------------------------------------------------- parsing

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "ki": 1 << 10, "mib": 1 << 20, "mi": 1 << 20,
    "gib": 1 << 30, "gi": 1 << 30, "tib": 1 << 40, "ti": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: object) -> int:
    """``"40GiB"`` -> 42949672960. Raises ValueError with the accepted forms."""
    if isinstance(text, bool):
        raise ValueError("expected a byte size, got a boolean")
    if isinstance(text, int):
        return text
    if isinstance(text, float) and text.is_integer():
        return int(text)
    match = _BYTES_RE.match(str(text))
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(
            "expected bytes as an integer or a number with a unit "
            "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 40GiB")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _parse_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    return int(str(value).strip())


def _parse_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    number = float(str(value).strip()) if not isinstance(value, (int, float)) else float(value)
    if not math.isfinite(number):
        raise ValueError("expected a finite number")
    return number


def _parse_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value.strip()


def _parse_json_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("not a JSON boolean")
    return value


def _parse_json_number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a JSON number")
    return _parse_float(value)


_PARSERS: dict[str, Callable[[object], SettingValue]] = {
    "bool": _parse_bool, "int": _parse_int, "float": _parse_float,
    "bytes": parse_bytes, "str": _parse_str, "path": _parse_str, "choice": _parse_str,
    "json_bool": _parse_json_bool, "json_number": _parse_json_number,
}


# ---------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class SettingRow:
    """One row of the table. ``minimum``/``maximum`` bound numbers; ``choices`` bound choices;
    ``pattern`` bounds strings. A ``transform`` row is a scheduler transform's option: read
    from ``kv_connector_extra_config`` only (under ``sparkcache_<name>``), never from the
    environment, because the transformed vLLM code reads it there."""

    name: str
    type: str  # bool | int | float | bytes | str | path | choice | json_bool | json_number
    default: SettingValue
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    transform: bool = False

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name

    @property
    def field(self) -> str:
        """The ``Settings`` field."""
        return self.name.lower()

    @property
    def key(self) -> str:
        """The key in ``kv_connector_extra_config``."""
        return ("sparkcache_" if self.transform else "") + self.name.lower()

    @property
    def label(self) -> str:
        """How errors and help name it."""
        return f"kv_connector_extra_config[{self.key!r}]" if self.transform else self.env_var

    def allowed(self) -> str:
        """The allowed range in words, used in help, in errors and in docs/RUNTIME_CONTRACT.md."""
        if self.type == "bool":
            return "true/false"
        if self.type == "json_bool":
            return "JSON true/false only (not a string, number or null)"
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.pattern:
            return f"matching {self.pattern}"
        fmt = format_bytes if self.type == "bytes" else (
            (lambda v: str(int(v))) if self.type == "int" else (lambda v: f"{v:g}"))
        if self.minimum is not None and self.maximum is not None:
            bounds = f"{fmt(self.minimum)} .. {fmt(self.maximum)}"
        elif self.minimum is not None:
            bounds = f">= {fmt(self.minimum)}"
        elif self.type == "path":
            return "a directory path"
        else:
            bounds = "any"
        if self.type == "json_number":
            return f"a finite JSON number {bounds} (not a string, boolean or null)"
        return bounds

    def parse(self, raw: object, source: str) -> SettingValue:
        where = f"{self.label}={raw!r}" + (f" (from {source})" if source != "env" and not self.transform else "")
        try:
            value = _PARSERS[self.type](raw)
        except (ValueError, TypeError) as exc:
            raise SettingsError(
                f"{where}: cannot parse as {self.type}: {exc}; allowed: {self.allowed()}") from None
        if self.choices and value not in self.choices:
            raise SettingsError(f"{where}: not allowed; use {self.allowed()}")
        if self.pattern and not re.fullmatch(self.pattern, value):
            raise SettingsError(f"{where}: not allowed; use a value {self.allowed()}")
        if self.minimum is not None and value < self.minimum:
            raise SettingsError(f"{where}: below the minimum; allowed: {self.allowed()}")
        if self.maximum is not None and value > self.maximum:
            raise SettingsError(f"{where}: above the maximum; allowed: {self.allowed()}")
        return value


_GiB = 1 << 30
_MiB = 1 << 20
RANK_PLACEHOLDER = "{rank}"

LOW_WATERMARK_SHARE = 80  # percent of MAX_BYTES where eviction stops, unless set

# S3's bucket names (3-63 lower-case letters, digits, '.' and '-'); an endpoint of scheme, host and
# port only (no user:password@, which would put a credential in a setting); a prefix of plain names.
REMOTE_BUCKET_PATTERN = r"([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])?"
REMOTE_ENDPOINT_PATTERN = r"(https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?/?)?"
REMOTE_PREFIX_PATTERN = r"(?!\.{1,2}(/|$))[A-Za-z0-9._-]{1,64}(/(?!\.{1,2}(/|$))[A-Za-z0-9._-]{1,64}){0,15}"

SETTINGS_TABLE: tuple[SettingRow, ...] = (
    SettingRow("ENABLED", "bool", True, "Switch the store on or off as a whole."),
    SettingRow("ROOT", "path", "", "Rank-local cache directory (required when enabled). "
               "Entries live under ROOT/NAMESPACE. '{rank}' in it is replaced by each "
               "tensor-parallel rank's number (e.g. /cache/rank{rank}): every rank then has "
               "its own root, and MAX_BYTES is per rank."),
    SettingRow("NAMESPACE", "str", "default", "Sub-directory of ROOT; separate namespaces "
               "never share entries or objects.", pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
    SettingRow("ACCESS_MODE", "choice", "read-write", "What the connector may do: restore and "
               "capture, only restore, only capture, or nothing.", choices=ACCESS_MODES),
    SettingRow("MAX_BYTES", "bytes", 40 * _GiB, "Store cap. Above it, maintenance evicts "
               "down to LOW_WATERMARK_BYTES and new publications are refused.", minimum=_MiB,
               maximum=1 << 50),
    SettingRow("LOW_WATERMARK_BYTES", "bytes", 32 * _GiB, "Eviction stops at this level; "
               "must be <= MAX_BYTES; unset, 80% of MAX_BYTES (see docs/SIZING.md).",
               minimum=0, maximum=1 << 50),
    SettingRow("MIN_FREE_BYTES", "bytes", 0, "Free-space floor of the filesystem under ROOT, "
               "whatever else fills it: below it publications are refused (low_free_space) "
               "and maintenance evicts until it is met again; 0 disables (see docs/SIZING.md).",
               minimum=0, maximum=1 << 50),
    SettingRow("TTL_SECONDS", "float", 0.0, "Evict entries not read or published for this "
               "long; 0 disables.", minimum=0),
    SettingRow("LEASE_SECONDS", "float", 300.0, "Lifetime of a pin that protects an entry "
               "being read or extended from eviction.", minimum=1, maximum=86400),
    SettingRow("CAPTURE_SLOTS", "int", 2, "Asynchronous capture slots per rank.",
               minimum=1, maximum=64),
    SettingRow("CAPTURE_SLOT_BYTES", "bytes", 3 * _GiB, "Host memory of one capture slot: a "
               "finished request's pages stream through it a slot's worth at a time (an entry of "
               "any length is stored); a hybrid model's boundary capture (its new pages and "
               "state, copied in one step) must fit in one.", minimum=64 << 10, maximum=1 << 40),
    SettingRow("MIN_SPAN_TOKENS", "int", 256, "Do not publish or restore spans shorter than "
               "this many tokens.", minimum=0, maximum=1 << 24),
    SettingRow("SYNC_LOADS", "bool", True, "Restore in the step that schedules the request "
               "(read, verified and placed before this step's forward; a failure reports every "
               "block of the load as invalid, which vLLM recomputes) instead of asynchronously, which costs one more "
               "engine step. Only attention-only single-group models; others load asynchronously."),
    SettingRow("PAGE_BLOCKS", "int", 16, "KV blocks per page object; a growing entry rewrites "
               "only its tail page.", minimum=1, maximum=4096),
    SettingRow("MAINTENANCE_MAX_ENTRIES", "int", 64, "Budget: entries one maintenance pass "
               "may evict.", minimum=1, maximum=1 << 20),
    SettingRow("MAINTENANCE_MAX_BYTES", "bytes", 4 * _GiB, "Budget: bytes one maintenance "
               "pass may reclaim.", minimum=_MiB, maximum=1 << 50),
    SettingRow("MAINTENANCE_MAX_MS", "float", 100.0, "Budget: wall milliseconds one "
               "maintenance pass may take.", minimum=1, maximum=60_000),
    SettingRow("WEIGHTS_FINGERPRINT", "str", "", "Declared fingerprint of the model weights "
               "(e.g. their commit or content hash), used in the store identity instead of the "
               "one computed from the local weight files; required when the weights are not "
               "local files. Change it whenever the weights change, or wrong KV is restored.",
               pattern=r"[A-Za-z0-9._:@/+=-]{0,256}"),
    SettingRow("MAINTENANCE_INTERVAL_SECONDS", "float", 1.0, "Guaranteed idle pause between "
               "two maintenance passes.", minimum=0.01, maximum=3600),
    SettingRow("ALLOW_FAILING_LOADS", "bool", False, "Run with vLLM's kv_load_failure_policy "
               "other than \"recompute\" (vLLM 0.32.0's default is \"fail\"): a refused restore "
               "(a corrupt or missing page) then fails the request instead of recomputing it."),
    SettingRow("REMOTE_BUCKET", "str", "", "Bucket of the S3-compatible object store that "
               "holds the shared tier's page objects (sparkcache.store.s3_backend); empty: no "
               "remote store. Credentials come from the standard AWS variables and files "
               "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, "
               "~/.aws/credentials, web identity, the instance's role), never from a setting. "
               "Set, every writing worker uploads what it publishes in the background and the "
               "scheduler fetches an entry the local store lacks before it offers "
               "(docs/REMOTE.md).",
               pattern=REMOTE_BUCKET_PATTERN),
    SettingRow("REMOTE_ENDPOINT", "str", "", "URL of the S3-compatible endpoint (scheme, host "
               "and port only, no user or path: e.g. http://seaweedfs:8333); empty: AWS S3 in "
               "the region AWS_REGION names.", pattern=REMOTE_ENDPOINT_PATTERN),
    SettingRow("REMOTE_PREFIX", "str", "sparkcache", "Key prefix under which the remote store "
               "keeps its keys (PREFIX/NAMESPACE/<identity digest>/ then objects/ab/<the 64-hex "
               "digest>, manifests/, keys/, access/: docs/REMOTE.md): '/'-separated names "
               "of letters, digits, '.', '_' and '-'.", pattern=REMOTE_PREFIX_PATTERN),
    SettingRow("REMOTE_CONNECT_TIMEOUT_SECONDS", "float", 2.0, "Limit on connecting to the "
               "remote endpoint, each try.", minimum=0.05, maximum=60),
    SettingRow("REMOTE_TIMEOUT_SECONDS", "float", 30.0, "Limit on one remote request, from "
               "connecting to its last byte; also the limit on its retries together.",
               minimum=0.1, maximum=600),
    SettingRow("REMOTE_RETRIES", "int", 2, "Retries of a remote request that failed to connect, "
               "timed out or met a server error (5xx), with exponential backoff, within "
               "REMOTE_TIMEOUT_SECONDS.", minimum=0, maximum=10),
    SettingRow("REMOTE_REQUESTS_IN_FLIGHT", "int", 4, "Remote requests one batch of puts, one "
               "batch exists, one round of a fetch's pointer search or a fetch's object GETs keep "
               "in flight at once (a fetch holds at most twice as many objects in memory).",
               minimum=1, maximum=64),
    SettingRow("REMOTE_UPLOAD_QUEUE_BYTES", "bytes", 8 * _GiB, "Bound on the object bytes of the "
               "entries waiting for their upload to the remote store (sparkcache.store.remote_tier); "
               "an entry that would pass it is not uploaded (counted as skipped).",
               minimum=1 << 20, maximum=1 << 50),
    SettingRow("REMOTE_FETCH_DEADLINE_SECONDS", "float", 5.0, "Limit on one fetch of an entry from "
               "the remote store after a local miss (lookup, manifest, objects, the local write); "
               "past it the fetch is a miss and nothing of it is written locally.",
               minimum=0.05, maximum=600),
    SettingRow("REMOTE_NEGATIVE_CACHE_SECONDS", "float", 2.0, "How long a prefix the remote store "
               "did not hold is not asked again (0: always ask).", minimum=0, maximum=3600),
    SettingRow("REMOTE_DRAIN_SECONDS", "float", 5.0, "At shutdown, how long a worker waits "
               "for its pending uploads to the remote store before it stops (what is left is not "
               "uploaded; the next publication of that prefix queues it again); within the time "
               "vLLM gives its worker to stop.", minimum=0, maximum=3600),
    SettingRow("REMOTE_MAX_BYTES", "bytes", 0, "Bound on the page objects' bytes of one namespace "
               "in the remote store (every identity under PREFIX/NAMESPACE); `python -m sparkcache "
               "remote-gc`, run from one place per namespace, evicts the entries least recently "
               "accessed there until under it (docs/REMOTE.md, \"Remote capacity\"); 0: no bound.",
               minimum=0),
    SettingRow("REMOTE_GC_GRACE_SECONDS", "float", 3600.0, "Age (by its LastModified) below which "
               "remote-gc never deletes a remote object or pointer that no manifest references: an "
               "upload in progress puts its objects before its manifest. Longer than the slowest "
               "upload plus the clock skew between the sweeper's host and the object store.",
               minimum=60, maximum=7 * 86400),
    # The scheduler transforms' options (docs/RUNTIME_CONTRACT.md); absent means upstream behaviour.
    SettingRow("GPU_LEASE_SECONDS", "json_number", None, "GPU-lease accounting: a deadline on "
               "every delayed free of a finished request's blocks, whose retired recurrent "
               "checkpoints are held with them and freed last.", minimum=0.001,
               maximum=86400, transform=True),
    SettingRow("PREFER_LOCAL_PREFIX", "json_bool", False, "Take the local attention depth and ask "
               "the connector only beyond it: never reload resident attention pages. Declares "
               "that the connector restores the recurrent state at the end of any load it "
               "performs (sparkcache's does).", transform=True),
    SettingRow("RETAIN_DECODE_CHECKPOINT", "json_bool", False, "Hash the newest block-aligned "
               "recurrent (Mamba align) state reached in decode, and a preempted request's state "
               "at its last block boundary.", transform=True),
    SettingRow("DROP_SUPERSEDED_CHECKPOINT", "json_bool", False, "With "
               "sparkcache_retain_decode_checkpoint true: drop the hash of the decode checkpoint "
               "a newer one supersedes.", transform=True),
)

# SPARKCACHE_* variables read by the tools around the connector, not by it.
TOOL_ENV = {
    "SPARKCACHE_TINYMODEL_CACHE": "where testing.tinymodel caches the offline tiny models",
    "SPARKCACHE_BUILD_CACHE": "build.py's cache directory (default .cache/)",
    "SPARKCACHE_REGISTRY_PORT": "build.py's local registry port (default 5050)",
    "SPARKCACHE_VERIFY_DIR": "the contract suite's inputs inside an image",
    "SPARKCACHE_UPSTREAM_SCOPE": "which upstream vLLM tests the contract suite runs",
}

_ROWS_BY_KEY = {row.key: row for row in SETTINGS_TABLE}
_ENV_NAMES = {row.env_var for row in SETTINGS_TABLE if not row.transform} | set(TOOL_ENV)


@dataclass(frozen=True)
class Settings:
    """Validated settings; field names are the table's lower-case names."""

    enabled: bool
    root: str
    namespace: str
    access_mode: str
    max_bytes: int
    low_watermark_bytes: int
    min_free_bytes: int
    ttl_seconds: float
    lease_seconds: float
    capture_slots: int
    capture_slot_bytes: int
    min_span_tokens: int
    sync_loads: bool
    page_blocks: int
    maintenance_max_entries: int
    maintenance_max_bytes: int
    maintenance_max_ms: float
    weights_fingerprint: str
    maintenance_interval_seconds: float
    allow_failing_loads: bool
    remote_bucket: str
    remote_endpoint: str
    remote_prefix: str
    remote_connect_timeout_seconds: float
    remote_timeout_seconds: float
    remote_retries: int
    remote_requests_in_flight: int
    remote_upload_queue_bytes: int
    remote_fetch_deadline_seconds: float
    remote_negative_cache_seconds: float
    remote_drain_seconds: float
    remote_max_bytes: int
    remote_gc_grace_seconds: float
    gpu_lease_seconds: float | None
    prefer_local_prefix: bool
    retain_decode_checkpoint: bool
    drop_superseded_checkpoint: bool

    @property
    def per_rank_root(self) -> bool:
        """ROOT names a directory per tensor-parallel rank (it holds ``{rank}``)."""
        return RANK_PLACEHOLDER in self.root

    def for_rank(self, tp_rank: int) -> "Settings":
        """The settings a tensor-parallel rank opens its store with: ROOT with ``{rank}``
        replaced by ``tp_rank`` (unchanged without it)."""
        if not self.per_rank_root:
            return self
        return dataclasses.replace(self, root=self.root.replace(RANK_PLACEHOLDER, str(int(tp_rank))))

    def replace(self, **changes: SettingValue) -> "Settings":
        """A copy with ``changes`` (by field name) applied and validated again."""
        merged = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        merged.update(changes)
        extra = {row.key: merged[row.field] for row in SETTINGS_TABLE if merged[row.field] is not None}
        return load_settings(env={}, extra_config=extra, require_root=False)


assert [f.name for f in dataclasses.fields(Settings)] == [r.field for r in SETTINGS_TABLE], \
    "table and Settings differ"


def load_settings(env: Mapping[str, str] | None = None,
                  extra_config: Mapping[str, object] | None = None,
                  *, require_root: bool = True) -> Settings:
    """Read, parse and validate every row. ``env`` defaults to ``os.environ``. An unknown
    ``SPARKCACHE_*`` variable or ``kv_connector_extra_config`` key is an error naming the
    nearest valid one: a typo must not silently run with the default."""
    env = os.environ if env is None else env
    extra = dict(extra_config or {})
    _reject_unknown(extra, env)
    values: dict[str, SettingValue] = {}
    unset = set()
    for row in SETTINGS_TABLE:
        if row.key in extra:
            values[row.field] = row.parse(extra[row.key], "kv_connector_extra_config")
        elif row.env_var in env and not row.transform:
            values[row.field] = row.parse(env[row.env_var], "env")
        else:
            values[row.field] = row.default
            unset.add(row.field)
    if "low_watermark_bytes" in unset:  # follows MAX_BYTES: a cap alone is a valid setting
        values["low_watermark_bytes"] = values["max_bytes"] * LOW_WATERMARK_SHARE // 100
    settings = Settings(**values)
    _check_combinations(settings, require_root)
    return settings


def transform_option(extra_config: Mapping[str, object] | None, key: str) -> SettingValue:
    """The scheduler transform option ``key`` (``sparkcache_<name>``) of vLLM's
    ``kv_connector_extra_config``, parsed by its row of the table exactly as ``load_settings``
    parses it; the row's default when the key is absent.

    The transforms' hooks (``sparkcache.hooks``, imported by the transformed vLLM only when
    their key is present) call this, so the transformed scheduler and the connector accept the same
    values. A bad value raises ``SettingsError`` (a ``ValueError``) naming the key, the value
    and the accepted values. Other keys of the dict are not looked at."""
    row = _ROWS_BY_KEY.get(key)
    if row is None or not row.transform:
        known = ", ".join(r.key for r in SETTINGS_TABLE if r.transform)
        raise SettingsError(f"{key!r} is not a scheduler transform option; known: {known}")
    extra = extra_config or {}
    if key not in extra:
        return row.default
    return row.parse(extra[key], "kv_connector_extra_config")


def _nearest(name: str, known: Mapping[str, str]) -> str:
    """'did you mean X?' for the closest of ``known`` (spelling -> what to suggest)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f"did you mean {known[close[0]]}?" if close else "known: " + ", ".join(sorted(set(known.values())))


_KEY_SPELLINGS = {**{row.field: f"{row.key!r} ({row.label})" for row in SETTINGS_TABLE},
                  **{row.key: f"{row.key!r} ({row.label})" for row in SETTINGS_TABLE}}
_ENV_SPELLINGS = {name: name for name in _ENV_NAMES}


def _reject_unknown(extra: Mapping[str, object], env: Mapping[str, str]) -> None:
    for key in extra:
        if key not in _ROWS_BY_KEY:
            raise SettingsError(
                f"kv_connector_extra_config key {key!r} is not a sparkcache setting; "
                f"{_nearest(str(key).lower(), _KEY_SPELLINGS)} Keys are the settings' lower-case "
                "names (the scheduler transforms' with 'sparkcache_'); see `sparkcache --help`.")
    transform_env = {row.env_var: row for row in SETTINGS_TABLE if row.transform}
    for name in env:
        if not name.startswith(ENV_PREFIX) or name in _ENV_NAMES:
            continue
        if name in transform_env:
            raise SettingsError(
                f"environment variable {name}={env[name]!r}: a scheduler transform option is read "
                f"from {transform_env[name].label} only; set it there and unset {name}.")
        raise SettingsError(
            f"environment variable {name}={env[name]!r} is not a sparkcache setting; "
            f"{_nearest(name, _ENV_SPELLINGS)} Unset it or fix its name; see `sparkcache --help`.")


# ---------------------------------------------------------------------------- direct calls
# The store's constructors (``PageStore``, ``StoreLayout.create``, ``PassBudget``,
# ``MaintenanceThread``) and the lock waits take their values from the table above when the
# connector or the CLI builds them, but a direct call skips it: these are the checks they make
# themselves, so a NaN, an infinity or a negative size is refused there too.


def check_number(where: str, name: str, value: object, *, minimum: float | None = None,
                 above: float | None = None, maximum: float | None = None,
                 integer: bool = False, unit: str = "", setting: str | None = None) -> int | float:
    """``value`` if it is a finite number (a whole one with ``integer``; never a boolean) with
    ``minimum <= value``, ``above < value`` and ``value <= maximum`` (each when given); else
    ``SettingsError`` naming ``where(name=value)``, what is wrong, what is allowed and the
    setting that sets it (``setting``, e.g. SPARKCACHE_LEASE_SECONDS)."""
    kind = "a whole number" if integer else "a finite number"
    bounds = [f"{op} {bound}" if isinstance(bound, int) else f"{op} {bound:g}"
              for op, bound in ((">=", minimum), (">", above), ("<=", maximum)) if bound is not None]
    allowed = " and ".join(b for b in bounds if b)
    allowed = f"{kind} {allowed}".strip() + (f" ({unit})" if unit else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problem = f"{type(value).__name__} is not a number"
    elif integer and not isinstance(value, int):
        problem = "not a whole number"
    elif not math.isfinite(value):
        problem = "not a finite number"
    elif ((minimum is not None and value < minimum) or (above is not None and value <= above)
          or (maximum is not None and value > maximum)):
        problem = "out of range"
    else:
        return value
    via = f" ({setting} sets it through the settings table)" if setting else ""
    raise SettingsError(f"{where}({name}={value!r}): {problem}; allowed: {allowed}. Fix: pass "
                        f"a value in that range{via}")


def check_root(root: object, label: str = "SPARKCACHE_ROOT") -> str:
    """``root`` if it can be a store root: a string, absolute, without a NUL byte, and nothing
    on its way that exists but is not a directory (a regular file, a dangling link). The one
    check of a root, made by the settings and by ``StoreLayout.create``; a ``{rank}``
    placeholder is checked as it is written (what exists above it). Else ``SettingsError``
    naming ``label``, the value and the fix."""
    if not isinstance(root, str):
        raise SettingsError(f"{label}={root!r}: not a string; allowed: an absolute directory path")
    if "\0" in root:
        raise SettingsError(f"{label}={root!r}: holds a NUL byte, which no path can; allowed: an "
                            f"absolute directory path. Fix: remove the NUL byte from {label}")
    if not os.path.isabs(root):
        raise SettingsError(f"{label}={root!r}: must be an absolute path; allowed: a directory "
                            "path starting with '/'")
    probe = os.path.normpath(root)
    while True:  # the deepest part of the path that exists must be a directory
        try:
            st = os.stat(probe)
        except (FileNotFoundError, NotADirectoryError):
            if os.path.lexists(probe) and os.path.islink(probe):
                raise SettingsError(f"{label}={root!r}: {probe} is a symbolic link to nothing; "
                                    f"allowed: a directory path. Fix: remove the link or point "
                                    f"{label} at a directory") from None
            parent = os.path.dirname(probe)
            if parent == probe:
                return root
            probe = parent
            continue
        except OSError:
            return root  # cannot be looked at from here (permissions): the store's open says
        if stat.S_ISDIR(st.st_mode):
            return root
        what = "a regular file" if stat.S_ISREG(st.st_mode) else "not a directory"
        where = "" if probe == os.path.normpath(root) else " (on its way)"
        raise SettingsError(f"{label}={root!r}: {probe}{where} is {what}; allowed: a directory "
                            f"path (made if missing). Fix: point {label} at a directory, or "
                            f"move {probe} away")


def check_namespace(namespace: object) -> str:
    """``namespace`` if the NAMESPACE row of the table allows it (a plain directory name);
    else ``SettingsError`` naming SPARKCACHE_NAMESPACE, the value and the allowed names."""
    row = _ROWS_BY_KEY["namespace"]
    if not isinstance(namespace, str) or not re.fullmatch(row.pattern or "", namespace):
        raise SettingsError(f"{row.env_var}={namespace!r}: not a plain directory name; allowed: "
                            f"a name {row.allowed()}. Fix: choose such a name")
    return namespace


def _check_combinations(s: Settings, require_root: bool) -> None:
    if s.low_watermark_bytes > s.max_bytes:
        raise SettingsError(
            f"SPARKCACHE_LOW_WATERMARK_BYTES={format_bytes(s.low_watermark_bytes)} is above "
            f"SPARKCACHE_MAX_BYTES={format_bytes(s.max_bytes)}; allowed: "
            "0 <= LOW_WATERMARK_BYTES <= MAX_BYTES (a gap of 10-25% of MAX_BYTES is typical, "
            "see docs/SIZING.md)")
    if s.enabled and s.access_mode != "disabled" and require_root and not s.root:
        raise SettingsError(
            "SPARKCACHE_ROOT='' : the store is enabled but has no directory; set "
            "SPARKCACHE_ROOT (or kv_connector_extra_config 'root') to a rank-local directory, "
            "or set SPARKCACHE_ENABLED=0")
    if s.root:
        check_root(s.root)
    stray = s.root.replace(RANK_PLACEHOLDER, "")
    if "{" in stray or "}" in stray:
        raise SettingsError(
            f"SPARKCACHE_ROOT={s.root!r}: the only placeholder a root may hold is "
            f"{RANK_PLACEHOLDER} (each tensor-parallel rank's number), e.g. /cache/rank{{rank}}; "
            "fix the braces")


def render_settings_help() -> str:
    """The table as text, for ``sparkcache --help`` and the docs."""
    lines = ["Settings (environment SPARKCACHE_<NAME>, or kv_connector_extra_config key "
             "<name> in lower case; the dict wins over the environment; an unknown name of "
             "either kind stops startup):", ""]
    for row in SETTINGS_TABLE:
        default = format_bytes(row.default) if row.type == "bytes" else repr(row.default)
        where = f"{row.label} (scheduler transform, not from the environment)" if row.transform else row.env_var
        lines.append(f"  {where}  ({row.type}, default {default}, allowed {row.allowed()})")
        lines.append(f"      {row.help}")
    lines += ["", "Read by the tools, not by the connector:"]
    lines += [f"  {name}  {help}" for name, help in TOOL_ENV.items()]
    return "\n".join(lines)


def render_transform_options_markdown() -> str:
    """The scheduler transforms' options as docs/RUNTIME_CONTRACT.md shows them, from the table
    (tests/test_runtime_contract.py keeps the doc equal to this)."""
    lead = textwrap.fill(
        "Set in `kv_transfer_config.kv_connector_extra_config`. The code each transform injects "
        "reads its keys with `sparkcache.settings.transform_option`, which parses them by their "
        "rows of the settings table (`sparkcache/settings.py`, `transform=True`: read from this "
        "dict only, never from the environment), as the sparkcache connector does at startup: "
        "the transformed scheduler accepts exactly the values below, whatever the connector. "
        "With a transform's keys absent it behaves as upstream (and does not import sparkcache). "
        "Any other value, `null` included, stops startup with a `SettingsError` (a `ValueError`) "
        "naming the key, the value and the accepted values.", width=100, break_on_hyphens=False)
    lines = [lead, "", "| key | accepted values | absent | effect |", "| --- | --- | --- | --- |"]
    for row in SETTINGS_TABLE:
        if row.transform:
            absent = "off" if row.default is None else json.dumps(row.default)
            lines.append(f"| `{row.key}` | {row.allowed()} | {absent}: upstream | {row.help} |")
    return "\n".join(lines)
