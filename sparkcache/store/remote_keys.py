"""The shared tier's key names in the bucket: one place, used by the tier and the capacity sweeper.

Under the prefix ``P`` (``SPARKCACHE_REMOTE_PREFIX``), per namespace ``NS`` and per identity digest
``IDD`` (``Identity.digest()``, 32 hex, whole; each tensor-parallel rank's shard has its own), and
its unit's digest ``UD`` (``Identity.unit_digest()``: rank 0's identity digest, the same for every
rank of an entry; ``IDD`` itself at rank 0):

- ``P/NS/UD/objects/ab/<digest>``: page and state objects, the local objects' bytes (an
  ``S3Location`` whose prefix is ``P/NS/UD`` names them: ``RemoteKeys.objects_base``). Objects are
  named by their BLAKE3 digest, so the ranks of a replicated layout (MLA: every rank holds the
  same latent pages) share theirs and the bucket holds them once; ranks whose bytes differ
  (heads split across ranks) simply name different objects;
- ``P/NS/IDD/manifests/<entry id>.mf``: the local manifest file's bytes, PUT (``If-None-Match: *``)
  once every object it names is in the bucket;
- ``P/NS/IDD/keys/<block key>``: for each block key an entry holds at an indexed position
  (``strides.indexed_positions``: the local block index's positions), the id of the entry
  uploaded first that holds it, PUT (``If-None-Match: *``) after that entry's manifest;
- ``P/NS/IDD/access/<entry id>``: an empty object, PUT each time a replica fetches the entry (its
  LastModified is the entry's last remote access).
So the objects under ``P/NS/UD/`` are named by the manifests under every ``P/NS/IDD/`` whose
identity's unit digest is ``UD`` (the census and the sweeper count them so).

A block key is used as it is when it is a plain hex name (``-`` allowed first, as a negative
integer's key is); any other key is named ``h`` and the SHA-256 of its UTF-8 bytes, so every
pointer's key is safe in S3 and two different block keys never share one.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass

from ..settings import REMOTE_PREFIX_PATTERN, SettingsError, check_namespace
from .identity import Identity
from .layout import MANIFEST_SUFFIX, check_object_digest, is_entry_id, is_identity_digest, is_object_digest
from .strides import indexed_positions

OBJECTS, MANIFESTS, POINTERS, ACCESS = "objects", "manifests", "keys", "access"
_PLAIN_BLOCK_KEY = re.compile(r"-?[0-9a-f]{1,128}")
_HASHED_BLOCK_KEY = re.compile(r"h[0-9a-f]{64}")


class KeyKind(enum.Enum):
    """What a key under an identity's prefix holds."""

    OBJECT = OBJECTS
    MANIFEST = MANIFESTS
    POINTER = POINTERS
    ACCESS = ACCESS


def pointer_name(block_key: str) -> str:
    """The last part of a block key's pointer key (the module docstring says how it is made)."""
    if not isinstance(block_key, str) or not block_key:
        raise ValueError(f"block key {block_key!r}: not a block key (a non-empty str); "
                         "make it with identity.block_key")
    if _PLAIN_BLOCK_KEY.fullmatch(block_key):
        return block_key
    return "h" + hashlib.sha256(block_key.encode()).hexdigest()


def pointer_positions(n_blocks: int) -> list[int]:
    """The positions of an entry's ``n_blocks`` block keys that get a pointer."""
    return indexed_positions(n_blocks)


@dataclass(frozen=True)
class RemoteKeys:
    """The keys of one identity's shard in one namespace under ``prefix``, its objects under its
    unit's (``unit_digest``; the identity's own when not given: rank 0's shard, or a listing of
    one digest's keys). Checked when made: ``ValueError`` (``SettingsError`` for the prefix and
    the namespace) naming the value."""

    prefix: str
    namespace: str
    identity_digest: str
    unit_digest: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not re.fullmatch(REMOTE_PREFIX_PATTERN, self.prefix):
            raise SettingsError(f"SPARKCACHE_REMOTE_PREFIX={self.prefix!r}: not '/'-separated plain names; "
                                f"allowed: matching {REMOTE_PREFIX_PATTERN}")
        check_namespace(self.namespace)
        if not self.unit_digest:
            object.__setattr__(self, "unit_digest", self.identity_digest)
        for name in ("identity_digest", "unit_digest"):
            if not is_identity_digest(getattr(self, name)):
                raise ValueError(f"{name.replace('_', ' ')} {getattr(self, name)!r}: not 32 lower-case hex "
                                 "characters (Identity.digest() or unit_digest(), whole)")

    @classmethod
    def of(cls, prefix: str, namespace: str, identity: Identity) -> "RemoteKeys":
        """The keys of ``identity``'s shard (an ``Identity``: its digest and its unit's)."""
        return cls(prefix, namespace, identity.digest(), identity.unit_digest())

    @property
    def base(self) -> str:
        """``P/NS/IDD``: the prefix of every key of this shard (an ``S3Location`` prefix)."""
        return f"{self.prefix}/{self.namespace}/{self.identity_digest}"

    @property
    def objects_base(self) -> str:
        """``P/NS/UD``: the prefix of this shard's objects, its unit's (an ``S3Location`` prefix)."""
        return f"{self.prefix}/{self.namespace}/{self.unit_digest}"

    def object_key(self, digest: str) -> str:
        check_object_digest(digest)
        return f"{self.objects_base}/{OBJECTS}/{digest[:2]}/{digest}"

    def manifest_key(self, entry_id: str) -> str:
        return f"{self.base}/{MANIFESTS}/{_entry(entry_id)}{MANIFEST_SUFFIX}"

    def pointer_key(self, block_key: str) -> str:
        return f"{self.base}/{POINTERS}/{pointer_name(block_key)}"

    def access_key(self, entry_id: str) -> str:
        return f"{self.base}/{ACCESS}/{_entry(entry_id)}"

    def kind_prefix(self, kind: KeyKind) -> str:
        """The prefix (with its trailing '/') a listing of one kind of this shard's keys asks
        (its objects: its unit's)."""
        return f"{self.objects_base if kind is KeyKind.OBJECT else self.base}/{kind.value}/"


def namespace_prefix(prefix: str, namespace: str) -> str:
    """``P/NS/``: what a listing of every identity's keys of a namespace asks."""
    return RemoteKeys(prefix, namespace, "0" * 32).base[:-32]


@dataclass(frozen=True)
class ParsedKey:
    """A listed key read back: whose shard (``keys``), which kind, and its name there (an
    object's digest, a manifest's or an access mark's entry id, a pointer's name)."""

    keys: RemoteKeys
    kind: KeyKind
    name: str


def parse_key(prefix: str, key: str) -> ParsedKey | None:
    """What ``key`` is under ``prefix``, or None for a key that is none of ours (another
    prefix, a malformed name, a temporary of a client)."""
    if not key.startswith(prefix + "/"):
        return None
    parts = key[len(prefix) + 1:].split("/")
    if len(parts) < 4:
        return None
    namespace, idd, kind_word, rest = parts[0], parts[1], parts[2], parts[3:]
    try:
        keys = RemoteKeys(prefix, namespace, idd)
        kind = KeyKind(kind_word)
    except ValueError:
        return None
    name = _name_of(kind, rest)
    return None if name is None else ParsedKey(keys, kind, name)


def _name_of(kind: KeyKind, rest: list[str]) -> str | None:
    if kind is KeyKind.OBJECT:
        ok = len(rest) == 2 and is_object_digest(rest[1]) and rest[0] == rest[1][:2]
        return rest[1] if ok else None
    if len(rest) != 1:
        return None
    name = rest[0]
    if kind is KeyKind.MANIFEST:
        entry_id = name[: -len(MANIFEST_SUFFIX)]
        return entry_id if name.endswith(MANIFEST_SUFFIX) and is_entry_id(entry_id) else None
    if kind is KeyKind.ACCESS:
        return name if is_entry_id(name) else None
    return name if _PLAIN_BLOCK_KEY.fullmatch(name) or _HASHED_BLOCK_KEY.fullmatch(name) else None


def _entry(entry_id: str) -> str:
    if not is_entry_id(entry_id):
        raise ValueError(f"entry id {entry_id!r}: not 40 lower-case hex characters (identity.entry_id_for)")
    return entry_id


__all__ = ["ACCESS", "MANIFESTS", "OBJECTS", "POINTERS", "KeyKind", "ParsedKey", "RemoteKeys",
           "namespace_prefix", "parse_key", "pointer_name", "pointer_positions"]
