"""Grouped-query attention on a CPU without a copy of the keys and values per query head.

transformers' ``sdpa`` attention gives ``scaled_dot_product_attention`` the key/value heads as
they are (``enable_gqa``) only where no attention mask is passed (or for a single query row); a
pass of several rows over a cache has a mask (a verify block, a batched pass of several sessions,
a prefill chunk after cached tokens), so it first copies every key and value head once per query
head that reads it (``repeat_kv``: 6x the layer's cache for Qwen2.5-1.5B's 12 query and 2 key/value
heads), every layer, every pass. On a CPU, torch's kernel takes the mask and the grouped heads
together and computes the same numbers (bit for bit, measured over the shapes in
``tests/test_attention.py``), so ``use_grouped_attention`` routes such passes there.

Over a long cache that is not enough: torch's CPU kernel, given grouped heads, still reads a
key/value head's keys and values once per query head that reads it (6 times for Qwen2.5-1.5B),
and once a layer's keys no longer fit in the CPU's caches that is the pass's cost (a one-row step
of the 1.5B target over 30,000 keys: 26 ms a layer where the keys are read in 6). So a short pass
(at most ``PACKED_ROWS`` rows once its query heads are stacked: decoding steps, verify blocks, a
draft's guesses) over at least ``LONG_KEYS`` keys gives the kernel each key/value head's query
heads as rows of one head (as transformers does for a single row with a mask), which reads them
once. Its logits are those of transformers' attention within float32 rounding, not bit for bit
(another blocking of the same sums); below ``LONG_KEYS`` nothing changes.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

log = structlog.get_logger(__name__)

_ENABLE_GQA_SINCE = (2, 5)  # the torch release that added scaled_dot_product_attention(enable_gqa=)
LONG_KEYS = 1024  # keys from which a short pass stacks each key/value head's query heads
PACKED_ROWS = 128  # the most query rows per key/value head that a pass stacks


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, except on a CPU: a short pass over a long cache gives the
    kernel each key/value head's query heads stacked as rows (``_packed``), and another pass of
    several query rows with a mask reads grouped key/value heads in place instead of copying them
    per query head. Everything else (a prefill's first chunk, another device, soft-capping, a
    position bias, attention weights asked for, dropout) goes to transformers' own function
    unchanged."""
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    rows = query.shape[2]
    grouped = (
        query.device.type == "cpu"
        and groups > 1
        and key.shape[1] * groups == query.shape[1]
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
    )
    if (
        grouped
        and key.shape[2] >= LONG_KEYS
        and groups * rows <= PACKED_ROWS
        and (attention_mask is not None or rows == 1)
    ):
        return _packed(query, key, value, attention_mask, scaling, groups), None
    if not (grouped and attention_mask is not None and rows > 1):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # with a mask transformers passes is_causal=False: the mask says what each row sees
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    groups: int,
) -> torch.Tensor:
    """Attention [batch, rows, query heads, head size] with the ``groups`` query heads that read
    each key/value head stacked as rows of one head ([batch, key/value heads, groups * rows, head
    size]; query head h reads key/value head h // groups), each stacked row seeing what its row's
    mask lets it see, so the kernel reads each key/value head once."""
    batch, heads, rows, _ = query.shape
    stacked = query.reshape(batch, key.shape[1], groups * rows, query.shape[3])
    if mask is not None and mask.shape[1] == 1:  # one mask for every head: each stacked head's rows see it
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * rows, -1)
    elif mask is not None:  # a mask per query head: stacked as the heads are
        mask = mask.reshape(mask.shape[0], key.shape[1], groups * rows, mask.shape[3])
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, rows, value.shape[3]).transpose(1, 2).contiguous()


def use_grouped_attention() -> bool:
    """Makes every model of this process that runs transformers' ``sdpa`` attention run
    ``grouped_sdpa_forward`` instead (through transformers' own ``AttentionInterface``; the same
    numbers, or over a long cache the same within float32 rounding: see the module's note). False,
    and nothing changed, on a torch without ``enable_gqa``."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < _ENABLE_GQA_SINCE:
        log.info("grouped_attention_unavailable", torch=torch.__version__)
        return False
    AttentionInterface.register("sdpa", grouped_sdpa_forward)
    return True
