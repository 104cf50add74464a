"""Manifests: the record that binds an entry to its identity, blocks and page objects.

File format (``<entry id>.mf``)::

    SPKM1 <sha256 hex of the body>\\n<body: canonical JSON>

The body is checked against the header digest on every decode, so any flipped or lost
byte makes the manifest ``corrupt``. Every field is validated; page names must be BLAKE3
hex digests (never paths), so a manifest cannot point outside the store.

Each page (and the state) also has its XXH3-128 (32 hex characters) in ``checksums`` (one per
page, in page order) and ``state_checksum``: a restore checks that instead of re-hashing BLAKE3
(about three times faster; ``docs/CONNECTOR.md``, "Verification"). They are optional fields of the
same format 2, so a sparkcache that predates them reads these manifests (and keeps their objects)
and verifies by the names; a manifest without them (written before, or a page reused from such an
entry: ``null`` in its place) is verified by its BLAKE3 names.

An entry of a hybrid model also names a ``state`` object: the recurrent (Mamba /
linear-attention) state of every recurrent layer after exactly ``block_count`` blocks, in
the layer order and byte layout the identity's ``kv_layout`` describes. Such an entry is
restorable to that depth only (``EntryIndex.longest_match(..., with_state=True)``); manifests
without the field (every attention-only entry) encode exactly as before.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .identity import Identity, entry_id_for
from .layout import is_entry_id, is_object_digest
from .reasons import Reason

MAGIC = b"SPKM1 "
HEADER_BYTES = len(MAGIC) + 64 + 1  # the header: magic, the body's sha256 in hex, newline
FORMAT = 2  # 2: page objects named by BLAKE3 (1, never released: sha256)
# 1M tokens in 16-token blocks is 62,500 keys of ~70 bytes: 4.4 MB. Larger is not ours.
MAX_MANIFEST_BYTES = 16 << 20
_MAX_NESTING = 16  # the body is four levels deep; deeper JSON is refused before parsing
# A page is page_blocks blocks of every layer of one rank: 16 blocks of a 70B model's 80
# layers (16 tokens, 8 KV heads of 128, fp16) are 84 MB. A recorded size above this is not
# a page this store wrote (and reading it would take the memory it names).
MAX_PAGE_BYTES = 1 << 32
_LATEST_TIME = 1 << 36  # seconds: year 4147; a later created_at is not a time this store wrote


class ManifestError(ValueError):
    """A manifest cannot be trusted. ``reason`` is ``corrupt`` (or ``unsafe_path``)."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = Reason(reason)
        self.detail = detail


@dataclass(frozen=True)
class PageRef:
    """One page object: its BLAKE3 name, its exact size in bytes and its XXH3-128 (hex; None
    when its manifest records none: written before the checksums)."""

    digest: str
    size: int
    checksum: str | None = None

    def to_json(self) -> list:
        """``[name, size]`` or ``[name, size, checksum]`` (the store's snapshot rows)."""
        return [self.digest, self.size] if self.checksum is None else [self.digest, self.size, self.checksum]


@dataclass(frozen=True)
class Manifest:
    """A published entry. Invariants (checked by ``decode``): the entry id is derived from
    the identity digest and the last block key; page i covers blocks
    ``[i*blocks_per_page, min((i+1)*blocks_per_page, len(block_keys)))``."""

    entry_id: str
    identity: Identity
    block_keys: tuple[str, ...]
    blocks_per_page: int
    pages: tuple[PageRef, ...]
    created_at: float
    state: PageRef | None = None  # recurrent state after block_count blocks (hybrid models)

    @property
    def identity_digest(self) -> str:
        return self.identity.digest()

    @property
    def objects(self) -> tuple[PageRef, ...]:
        """Every object the entry references: its pages, then its state."""
        return self.pages + ((self.state,) if self.state is not None else ())

    @property
    def block_count(self) -> int:
        return len(self.block_keys)

    def pages_for_blocks(self, n_blocks: int) -> tuple[PageRef, ...]:
        """The pages that hold the first ``n_blocks`` blocks."""
        return self.pages[: -(-n_blocks // self.blocks_per_page)]


def pages_needed(n_blocks: int, blocks_per_page: int) -> int:
    return -(-n_blocks // blocks_per_page)


def encode(manifest: Manifest) -> bytes:
    fields = {
        "format": FORMAT,
        "entry_id": manifest.entry_id,
        "identity": manifest.identity.to_dict(),
        "block_keys": list(manifest.block_keys),
        "blocks_per_page": manifest.blocks_per_page,
        "pages": [[p.digest, p.size] for p in manifest.pages],
        "created_at": manifest.created_at,
    }
    if any(p.checksum is not None for p in manifest.pages):
        fields["checksums"] = [p.checksum for p in manifest.pages]
    if manifest.state is not None:
        fields["state"] = [manifest.state.digest, manifest.state.size]
        if manifest.state.checksum is not None:
            fields["state_checksum"] = manifest.state.checksum
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def header_checksum(data: bytes) -> bytes:
    """The body's sha256 (hex) that a manifest's header records (check the magic first)."""
    return data[len(MAGIC): HEADER_BYTES - 1]


def body_matches(data: bytes) -> bool:
    """Whether a whole manifest's body hashes to the checksum its header records."""
    return hashlib.sha256(data[HEADER_BYTES:]).hexdigest().encode() == header_checksum(data)


def decode(data: bytes, *, expected_entry_id: str | None = None,
           expected_identity_digest: str | None = None) -> Manifest:
    """Parse and validate; raises ``ManifestError`` for anything that does not check out."""
    if (len(data) < HEADER_BYTES or not data.startswith(MAGIC)
            or data[HEADER_BYTES - 1:HEADER_BYTES] != b"\n"):
        raise ManifestError(Reason.CORRUPT, "bad header (truncated or not a sparkcache manifest)")
    if not body_matches(data):
        raise ManifestError(Reason.CORRUPT, "body does not match its checksum")
    body = data[HEADER_BYTES:]
    if _nesting(body) > _MAX_NESTING:
        raise ManifestError(Reason.CORRUPT, f"JSON nested deeper than {_MAX_NESTING} levels")
    try:
        raw = _DECODER.decode(body.decode())
        if not isinstance(raw, dict):
            raise ManifestError(Reason.CORRUPT, f"body is a JSON {type(raw).__name__}, not an object")
        return _from_fields(raw, expected_entry_id, expected_identity_digest)
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, ArithmeticError,
            MemoryError) as exc:
        raise ManifestError(Reason.CORRUPT, f"bad field: {type(exc).__name__}: {exc}") from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a manifest may hold")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _nesting(body: bytes) -> int:
    """Deepest bracket nesting of a JSON text (brackets inside strings count too: an upper
    bound, which is what a guard needs)."""
    depth = deepest = 0
    for byte in body.translate(None, _NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _from_fields(raw: dict[str, Any], expected_entry_id: str | None,
                 expected_identity_digest: str | None) -> Manifest:
    """``raw``: the decoded JSON body, whose values are of any type until checked here."""
    if raw.get("format") != FORMAT or type(raw.get("format")) is not int:
        raise ManifestError(Reason.CORRUPT, f"format {raw.get('format')!r}, this sparkcache reads format "
                            f"{FORMAT} (pages named by BLAKE3): delete the manifest or start a new "
                            "SPARKCACHE_NAMESPACE")
    if not isinstance(raw.get("identity"), dict):
        raise ManifestError(Reason.CORRUPT, "identity must be a JSON object")
    identity = Identity.from_dict(raw["identity"])
    keys = raw.get("block_keys")
    if type(keys) is not list or not keys or set(map(type, keys)) != {str} or "" in keys:
        raise ManifestError(Reason.CORRUPT, "block_keys must be a non-empty list of strings")
    keys = tuple(keys)
    bpp = raw.get("blocks_per_page")
    if not _is_count(bpp) or bpp == 0:
        raise ManifestError(Reason.CORRUPT, f"blocks_per_page {bpp!r}")
    if not isinstance(raw.get("pages"), list):
        raise ManifestError(Reason.CORRUPT, "pages must be a list of [name, size]")
    checksums = raw.get("checksums", [None] * len(raw["pages"]))
    if type(checksums) is not list or len(checksums) != len(raw["pages"]):
        raise ManifestError(Reason.CORRUPT, "checksums must be a list with one entry per page")
    pages = [_page_ref(item, "page", checksum) for item, checksum in zip(raw["pages"], checksums)]
    state = (_page_ref(raw["state"], "state", raw.get("state_checksum")) if raw.get("state") is not None
             else None)
    if state is None and raw.get("state_checksum") is not None:
        raise ManifestError(Reason.CORRUPT, "state_checksum without a state")
    if len(pages) != pages_needed(len(keys), bpp):
        raise ManifestError(Reason.CORRUPT, f"{len(pages)} pages for {len(keys)} blocks at {bpp}/page")
    entry_id = raw.get("entry_id")
    if not is_entry_id(entry_id) or entry_id != entry_id_for(identity.digest(), keys[-1]):
        raise ManifestError(Reason.CORRUPT, f"entry id {entry_id!r} does not match identity and blocks")
    if expected_entry_id is not None and entry_id != expected_entry_id:
        raise ManifestError(Reason.CORRUPT, f"file named {expected_entry_id} holds entry {entry_id}")
    if expected_identity_digest is not None and identity.digest() != expected_identity_digest:
        raise ManifestError(Reason.CORRUPT, "identity does not match its directory")
    created = raw.get("created_at")
    if (isinstance(created, bool) or not isinstance(created, (int, float))
            or not 0 <= created < _LATEST_TIME):
        raise ManifestError(Reason.CORRUPT, f"created_at {created!r:.40}")
    return Manifest(entry_id, identity, keys, bpp, tuple(pages), float(created), state)


def _page_ref(item: object, what: str, checksum: object = None) -> PageRef:
    if not isinstance(item, list) or len(item) != 2:
        raise ManifestError(Reason.CORRUPT, f"{what} {item!r:.80} is not [name, size]")
    digest, size = item
    if not is_object_digest(digest):
        raise ManifestError(Reason.UNSAFE_PATH, f"{what} name {digest!r:.80} is not a BLAKE3 digest "
                            "(paths, '..' and absolute names are refused)")
    if not _is_count(size) or size > MAX_PAGE_BYTES:
        raise ManifestError(Reason.CORRUPT, f"{what} size {size!r:.40}")
    if checksum is not None and not is_checksum(checksum):
        raise ManifestError(Reason.CORRUPT, f"{what} checksum {checksum!r:.40} is not 32 lower-case hex "
                            "characters (an XXH3-128)")
    return PageRef(digest, size, checksum)


def is_checksum(value: object) -> bool:
    """An XXH3-128 as a manifest records it: 32 lower-case hex characters."""
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)
