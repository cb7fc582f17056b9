"""Grouped-query attention on a CPU without a copy of the keys and values per query head.

transformers' ``sdpa`` attention gives ``scaled_dot_product_attention`` the key/value heads as
they are (``enable_gqa``) only where no attention mask is passed (or for a single query row); a
pass of several rows over a cache has a mask (a verify block, a batched pass of several sessions,
a prefill chunk after cached tokens), so it first copies every key and value head once per query
head that reads it (``repeat_kv``: 6x the layer's cache for Qwen2.5-1.5B's 12 query and 2 key/value
heads), every layer, every pass. On a CPU, torch's kernel takes the mask and the grouped heads
together and computes the same numbers (bit for bit, measured over the shapes in
``tests/test_attention.py``), so ``use_grouped_attention`` routes such passes there.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

log = structlog.get_logger(__name__)

_ENABLE_GQA_SINCE = (2, 5)  # the torch release that added scaled_dot_product_attention(enable_gqa=)


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
    """transformers' ``sdpa`` attention, except that a CPU pass of several query rows with a mask
    reads grouped key/value heads in place instead of copying them per query head. Everything
    else (no mask, one row, another device, soft-capping, a position bias, attention weights asked
    for) goes to transformers' own function unchanged."""
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    grouped = (
        query.device.type == "cpu"
        and attention_mask is not None
        and query.shape[2] > 1
        and groups > 1
        and key.shape[1] * groups == query.shape[1]
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
    )
    if not grouped:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # with a mask transformers passes is_causal=False: the mask says what each row sees
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention() -> bool:
    """Makes every model of this process that runs transformers' ``sdpa`` attention run
    ``grouped_sdpa_forward`` instead (through transformers' own ``AttentionInterface``; the same
    numbers, see the module's note). False, and nothing changed, on a torch without ``enable_gqa``."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < _ENABLE_GQA_SINCE:
        log.info("grouped_attention_unavailable", torch=torch.__version__)
        return False
    AttentionInterface.register("sdpa", grouped_sdpa_forward)
    return True
