"""What a rank's KV cache is made of, decided once from vLLM's ``KVCacheConfig``.

- ``ATTENTION``: every group is full attention. An entry is pages: every layer's blocks.
- ``HYBRID``: full-attention groups plus recurrent groups (Mamba / linear attention) in
  ``mamba_cache_mode="align"``. An entry is the attention groups' pages plus one state
  object: every recurrent layer's state after exactly the entry's last block, taken from
  the block vLLM offers for that boundary and restored into block-table column ``n - 1``.
- ``UNSUPPORTED``: anything else (sliding window, recurrent groups without ``align``, ...):
  nothing is offered or captured, and ``unsupported`` says why.

``description`` is the identity's ``kv_layout``: it changes whenever stored bytes would
(spec type, heads, head size, dtypes, state shapes, block size, layer names per group,
vLLM's kv_cache_layout and, for recurrent groups, the conv-state layout and padding). An
attention-only layout describes itself exactly as before recurrent groups were supported,
so stored entries keep their identity.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM's types, for readers and type checkers; never imported at run time here
    from vllm.v1.kv_cache_interface import KVCacheConfig


class LayoutKind(enum.Enum):
    ATTENTION = "attention"
    HYBRID = "hybrid"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class KVLayout:
    kind: LayoutKind
    description: str
    page_groups: tuple[int, ...]   # full-attention groups: their blocks make the pages
    state_groups: tuple[int, ...]  # recurrent groups: their state at a boundary, one object
    unsupported: str = ""          # why nothing is offered or captured (UNSUPPORTED only)

    @property
    def has_state(self) -> bool:
        return self.kind is LayoutKind.HYBRID


def _conv_state_layout() -> str:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:  # another vLLM: recorded as such, so its entries never mix with ours
        return "unknown"
    return str(get_conv_state_layout())


def describe_kv_layout(kv_cache_config: KVCacheConfig) -> KVLayout:
    groups = []
    pages: list[int] = []
    states: list[int] = []
    problems: list[str] = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        described = {
            "spec": kind, "layers": list(g.layer_names),
            "block_size": getattr(spec, "block_size", None),
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "dtype": str(getattr(spec, "dtype", getattr(spec, "dtypes", ""))),
            "shapes": str(getattr(spec, "shapes", "")),
        }
        if kind == "FullAttentionSpec" and not getattr(spec, "sliding_window", None):
            pages.append(i)
        elif kind == "MambaSpec":
            described.update({
                "mamba_type": str(getattr(spec.mamba_type, "value", spec.mamba_type)),
                "mamba_cache_mode": spec.mamba_cache_mode,
                "page_size_padded": spec.page_size_padded,
                "tp_replicated": bool(getattr(spec, "tp_replicated", False)),
                "num_speculative_blocks": spec.num_speculative_blocks,
                "conv_state_layout": _conv_state_layout(),
            })
            if spec.mamba_cache_mode != "align":
                problems.append(f"group {i} ({g.layer_names[0]}, ...) is recurrent with "
                                f"mamba_cache_mode={spec.mamba_cache_mode!r}; sparkcache stores "
                                "recurrent state only in 'align' mode (--mamba-cache-mode align)")
            elif spec.num_speculative_blocks:
                problems.append(f"group {i} keeps speculative recurrent blocks; sparkcache does "
                                "not store recurrent state with speculative decoding")
            states.append(i)
        else:
            problems.append(f"group {i} ({g.layer_names[0]}, ...) is {kind}"
                            + (" with a sliding window" if kind == "FullAttentionSpec" else "")
                            + "; sparkcache stores full attention and align-mode recurrent state only")
        groups.append(described)
    description = json.dumps({"groups": groups,
                              "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", ""))},
                             sort_keys=True, separators=(",", ":"), allow_nan=False)
    if problems or not pages:
        kind = LayoutKind.UNSUPPORTED
        why = "; ".join(problems) or "no full-attention group"
    else:
        kind, why = (LayoutKind.HYBRID if states else LayoutKind.ATTENTION), ""
    return KVLayout(kind, description, tuple(pages), tuple(states), why)
