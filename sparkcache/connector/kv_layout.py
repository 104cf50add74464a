"""What a rank's KV cache is made of, decided once from vLLM's ``KVCacheConfig``.

Each KV cache group gets a ``GroupRole`` from what its spec *is* (vLLM's spec types, by
``type``; a group mixing spec types, ``UniformTypeKVCacheSpecs``, is unwrapped layer by layer):

- ``PAGES``: attention whose every block before the boundary vLLM keeps: ``FullAttentionSpec``
  (with a sliding window too: vLLM then keeps and hashes every block) and ``MLAAttentionSpec``
  (the latent cache, and the sparse indexer's key cache, ``tokens_per_state`` > 1, in the same
  group: whole blocks, never sliced by state). An entry stores every block.
- ``STATE``: recurrent groups (Mamba, linear attention such as KDA: ``MambaSpec``) in
  ``mamba_cache_mode="align"``: their state after exactly the entry's last block, taken from
  the block vLLM offers for that boundary and restored into block-table column ``n - 1``
  (with speculative decoding too: the draft blocks come after that column, never stored).
- ``WINDOW``: sliding-window attention (``SlidingWindowSpec``: Gemma 3, gpt-oss, Mistral).
  vLLM frees a request's blocks that fall behind the window as it runs, and a request resumed
  at boundary N reads only the blocks holding tokens [N - window + 1, N) (plus the
  ``extra_retained_tokens`` vLLM keeps below them): ``window_blocks`` =
  ceil((window - 1 + extra) / block) blocks, the ones vLLM allocates for a load to N (it pads
  the columns before them with its null block). So like a state, an entry holds the window
  of its own boundary, copied in the step that computes past it (while vLLM still holds it),
  restored into columns N/block - window_blocks .. N/block - 1, never into a column the
  request already holds from its local prefix cache.
- The EAGLE / MTP draft layers' group (``is_eagle_group``, or every group when vLLM runs an
  EAGLE-style drafter and flags none) is pages too, under one more condition: a drafter's KV
  at position p is computed from the target's hidden state at p and the token at p + 1, so
  an entry's keys then cover the token after each block (``lookahead``, ``keys.BlockKeys``),
  and a prefix is offered only to a request whose next token is the one the KV was computed
  with. vLLM's own prefix cache gets the same guarantee by matching a whole block more and
  dropping it (``eagle_proof_margin``).
- ``NOT_NEEDED``: nothing in it is read by a request resumed at a block boundary: GLM's
  indexer tail ring (``CircularBufferSpec``, ``_role`` says why) and groups vLLM marks as not
  transferable (rebuilt from their source group after a load). Neither captured nor placed.
- ``REFUSED``: anything else (recurrent state outside align mode, a group in blocks of
  another size than the engine's, recurrent draft layers, a drafter other than EAGLE / MTP
  (DFlash, DSpark), HiSparse groups, chunked local attention), naming the group, what it is
  and the fix; a spec type sparkcache does not know is refused too, never guessed from a
  base class.

``kind`` sums the roles up: ``ATTENTION`` (pages only), ``HYBRID`` (pages and a boundary
object: every recurrent layer's state and every windowed layer's window at the entry's end,
one store object, the store's "state"; a model whose every layer is windowed, such as
Mistral, has pages of no bytes) or ``UNSUPPORTED`` (a refused group, or no attention group):
nothing is offered or captured.

``description`` is the identity's ``kv_layout``. It is the same on the scheduler and the
workers: vLLM hands the scheduler, for a group mixing spec types, the group's first spec
(``generate_scheduler_kv_cache_config``), so each group is described by that spec (every
field: heads, head sizes, dtypes, state shapes, ``tokens_per_state``, ``cache_role``,
speculative and checkpoint blocks, ...) and its layers, plus vLLM's ``kv_cache_layout`` and
the conv-state layout. The group's other layers' specs follow from the model and vLLM's
version (both in the identity), and every page's size is checked against the worker's
tensors before it is placed. The kernel block size is not in it (docs/CONNECTOR.md says why).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM's types, for readers and type checkers; never imported at run time here
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec


class LayoutKind(enum.Enum):
    ATTENTION = "attention"
    HYBRID = "hybrid"
    UNSUPPORTED = "unsupported"


class GroupRole(enum.Enum):
    PAGES = "pages"
    STATE = "state"
    NOT_NEEDED = "not-needed"  # nothing in it is read before a block boundary (a ring)
    WINDOW = "window"
    REFUSED = "refused"


@dataclass(frozen=True)
class KVLayout:
    kind: LayoutKind
    description: str
    page_groups: tuple[int, ...]   # PAGES groups: their blocks make the pages
    state_groups: tuple[int, ...]  # STATE groups: their state at a boundary, one object
    unsupported: str = ""          # why nothing is offered or captured (UNSUPPORTED only)
    lookahead: int = 0             # tokens after a block its key covers (1: a drafter reads them)
    window_groups: tuple[int, ...] = ()  # WINDOW groups: their window at a boundary, in that object
    window_blocks: tuple[int, ...] = ()  # blocks before the boundary each window group reads

    @property
    def has_state(self) -> bool:
        """Entries end with a boundary object (recurrent states, windows)."""
        return self.kind is LayoutKind.HYBRID

    def windows_at(self, n_blocks: int) -> tuple[int, ...]:
        """Blocks of each window group an entry of ``n_blocks`` blocks holds."""
        return tuple(min(n_blocks, k) for k in self.window_blocks)


def _conv_state_layout() -> str:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:  # another vLLM: recorded as such, so its entries never mix with ours
        return "unknown"
    return str(get_conv_state_layout())


def _plain(value: object) -> object:
    """A spec field as JSON: enums by value, dtypes and fractions as text, tuples as lists."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _fields(spec: KVCacheSpec) -> dict[str, object]:
    out = {f.name: _plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)
           if f.name != "kv_cache_specs"}
    for name, value in out.items():
        if isinstance(value, str) and " at 0x" in value:  # an address: another in every process
            raise ValueError(f"sparkcache: {type(spec).__name__}.{name}={value} has no stable text "
                             "form for the store identity (the scheduler and the workers would "
                             "disagree); fix: a vLLM whose spec fields are plain values, or "
                             "SPARKCACHE_ACCESS_MODE=disabled")
    return out


def _layer_specs(spec: KVCacheSpec, layer_names: list[str]) -> list[tuple[str, KVCacheSpec]]:
    """(layer, spec) of every layer of a group."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.items())
    return [(name, spec) for name in layer_names]


def _first_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The group's spec as vLLM hands it to the scheduler (``generate_scheduler_kv_cache_config``)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


# GLM-5.3's indexer tail ring (``models/glm5next``): the one ring whose reading sparkcache has
# followed in vLLM's code (``_role``); another model's ring may hold what a resumed request reads.
TAIL_RING_SUFFIX = ".indexer.tail_cache"


def _role(spec: KVCacheSpec, layer: str, block_size: int | None) -> tuple[GroupRole, str]:
    """A layer's role by its spec's exact type, and why when refused. ``block_size``: the
    engine's (every stored group's block must be it: a boundary is a column of every table)."""
    from vllm.v1 import kv_cache_interface as k

    kind = type(spec).__name__
    stored_size_ok = block_size is None or spec.block_size == block_size
    if type(spec) in (k.FullAttentionSpec, k.MLAAttentionSpec):
        # With a sliding window but a full-attention spec (HMA off, or page sizes that could
        # not be unified), vLLM keeps and hashes every block: pages like any other.
        if spec.attention_chunk_size:
            return GroupRole.REFUSED, (f"{kind} with chunked local attention; sparkcache does "
                                       "not store it")
        if spec.non_causal:  # a prefix's KV depends on the tokens after it (prefix-LM attention)
            return GroupRole.REFUSED, (f"{kind} with non-causal attention: a prefix's KV depends "
                                       "on what follows it, so it is never reused")
        if getattr(spec, "non_causal_multi_token_decode", False):
            return GroupRole.REFUSED, (f"{kind} of a drafter with non-causal multi-token decode "
                                       "(DSpark); sparkcache has not followed what its KV "
                                       "depends on")
        if not stored_size_ok:
            return GroupRole.REFUSED, (f"{kind} in blocks of {spec.block_size} tokens, not the "
                                       f"engine's {block_size}")
        return GroupRole.PAGES, ""
    if type(spec) is k.MambaSpec:
        if spec.mamba_cache_mode != "align":
            return GroupRole.REFUSED, (f"recurrent with mamba_cache_mode={spec.mamba_cache_mode!r}; "
                                       "sparkcache stores recurrent state only in 'align' mode "
                                       "(--mamba-cache-mode align)")
        if not stored_size_ok:  # its state would be looked for in another column
            return GroupRole.REFUSED, (f"recurrent in blocks of {spec.block_size} tokens, not the "
                                       f"engine's {block_size} (leave --mamba-block-size unset)")
        # Speculative blocks are scratch after the running column; the state at boundary
        # m * block_size is always in column m - 1, where vLLM offers and reads it.
        return GroupRole.STATE, ""
    if type(spec) is k.CircularBufferSpec:
        # GLM's indexer tail ring: one block per request, never prefix-cached by vLLM either.
        # At a boundary that is a multiple of the block size (a multiple of the ring, itself
        # a multiple of the pool) every pool is complete and compressed into the indexer's
        # key cache; a resumed prefill starts pool-aligned and reads no ring slot before it.
        if layer.endswith(TAIL_RING_SUFFIX) and (block_size is None or block_size % spec.block_size == 0):
            return GroupRole.NOT_NEEDED, ""
        return GroupRole.REFUSED, (f"{kind} of {layer}, a ring sparkcache does not know (only "
                                   "GLM-5.3's indexer tail ring, at a block size that is a multiple "
                                   "of it, is known not to be read at a block boundary)")
    if type(spec) is k.SlidingWindowSpec:
        if not stored_size_ok:  # its window would be looked for in other columns
            return GroupRole.REFUSED, (f"{kind} in blocks of {spec.block_size} tokens, not the "
                                       f"engine's {block_size}")
        return GroupRole.WINDOW, ""
    return GroupRole.REFUSED, (f"{kind}, a KV cache spec sparkcache does not store (it stores full "
                               "attention, MLA, sliding windows and align-mode recurrent state)")


# Drafters whose KV at position p depends on the tokens after p (their input at p is the
# target's hidden state at p and the token at p + 1; module j of a multi-module MTP chain reads
# the token at p + j): ``SpeculativeConfig.use_eagle`` minus the DFlash / DSpark drafters, whose
# reads sparkcache has not followed.
NEXT_TOKEN_DRAFTERS = frozenset({"eagle", "eagle3", "mtp"})
OTHER_HIDDEN_STATE_DRAFTERS = frozenset({"dflash", "dspark"})


def _group_problem(group: KVCacheGroupSpec, role: GroupRole) -> str:
    """Why a group is refused whatever its spec says, or ``""``."""
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    if group.host_resident or group.role is not KVCacheGroupRole.DEFAULT:
        return "a HiSparse host or indexer group; sparkcache does not store those"
    if group.is_eagle_group and role is GroupRole.STATE:  # (a windowed draft group is stored)
        return ("recurrent draft layers (EAGLE / MTP); sparkcache stores a drafter's attention "
                "pages, not its recurrent state")
    return ""


def describe_kv_layout(kv_cache_config: KVCacheConfig, block_size: int | None = None,
                       speculative_method: str | None = None, prefill_lookahead: int = 1) -> KVLayout:
    """``block_size``: the engine's (``cache_config.block_size``); a stored group in blocks of
    another size is refused. ``speculative_method``: vLLM's ``speculative_config.method``, if
    any; ``prefill_lookahead``: how many tokens past a position its drafter reads there
    (``VllmConfig.num_prefill_lookahead_tokens``: one, or a multi-module MTP chain's length).
    Raises ``ValueError`` for a group whose layers would be stored differently: the
    scheduler sees only its first layer and would decide otherwise."""
    groups = []
    pages: list[int] = []
    states: list[int] = []
    windows: dict[int, int] = {}  # window group -> blocks it reads before a boundary
    problems: list[str] = []
    if speculative_method in OTHER_HIDDEN_STATE_DRAFTERS:
        problems.append(f"speculative decoding with a {speculative_method} drafter, whose KV "
                        "sparkcache has not followed; fix: --speculative-config with method mtp, "
                        "eagle or eagle3, or none")
    drafted = speculative_method in NEXT_TOKEN_DRAFTERS or any(
        g.is_eagle_group for g in kv_cache_config.kv_cache_groups)
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        names = list(g.layer_names)
        first = _first_spec(g.kv_cache_spec)
        verdicts = {_role(spec, layer, block_size) for layer, spec in _layer_specs(g.kv_cache_spec, names)}
        roles = {r for r, _ in verdicts}
        if len(roles) > 1:
            raise ValueError(f"sparkcache: KV cache group {i} ({', '.join(names)}) mixes layers "
                             f"sparkcache would store differently ({', '.join(sorted(r.value for r in roles))}); "
                             "the scheduler sees only its first layer, so it would decide otherwise "
                             "than the workers. Fix: SPARKCACHE_ACCESS_MODE=disabled for this model")
        (role,) = roles
        if not g.enable_kv_transfer:
            role = GroupRole.NOT_NEEDED  # vLLM rebuilds it from its source group after a load
        elif role is not GroupRole.REFUSED and _group_problem(g, role):
            verdicts = {(GroupRole.REFUSED, _group_problem(g, role))}
            role = GroupRole.REFUSED
        if role is GroupRole.REFUSED:
            why = "; ".join(sorted(w for _, w in verdicts if w))
            if why:
                problems.append(f"group {i} ({names[0]}, ...) is {why}")
        elif role is GroupRole.PAGES:
            pages.append(i)
        elif role is GroupRole.STATE:
            states.append(i)
        elif role is GroupRole.WINDOW:
            windows[i] = _window_blocks(first)
        described: dict[str, object] = {"role": role.value, "spec": type(first).__name__,
                                     "fields": _fields(first), "layers": names,
                                     "eagle": g.is_eagle_group}
        if role is GroupRole.STATE:
            described["conv_state_layout"] = _conv_state_layout()
        groups.append(described)
    lookahead = max(1, prefill_lookahead) if drafted else 0
    described_layout: dict[str, object] = {
        "groups": groups, "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", ""))}
    if lookahead:  # only then: every identity without a drafter stays what it was
        described_layout["key_lookahead"] = lookahead
    description = json.dumps(described_layout, sort_keys=True, separators=(",", ":"), allow_nan=False)
    if problems or not (pages or windows):
        kind = LayoutKind.UNSUPPORTED
        why = "; ".join(problems) or "no attention group"
    else:
        kind, why = (LayoutKind.HYBRID if states or windows else LayoutKind.ATTENTION), ""
    return KVLayout(kind, description, tuple(pages), tuple(states), why, lookahead,
                    tuple(windows), tuple(windows.values()))


def _window_blocks(spec: KVCacheSpec) -> int:
    """Blocks before a boundary N that a request resumed at N reads or vLLM keeps for it:
    tokens [N - window + 1 - extra_retained_tokens, N) (``get_num_skipped_tokens``)."""
    tokens = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
    return -(-tokens // spec.block_size)
