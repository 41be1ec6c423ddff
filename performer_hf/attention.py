"""FAVOR attention behind the transformers attention interface.

Converted models run with `config._attn_implementation == "performer"`. Two functions are registered under that
name: the attention function, which every supported model already calls with its own q, k, v (so Q/K/V layouts,
rotary embeddings and grouped heads stay the model's business), and a mask function, which hands the attention the
(batch, kv_length) padding mask instead of an O(L^2) boolean matrix. Each converted attention module owns a
`FavorAttention` child (attribute `performer`) with its projection as a buffer, so the projection travels with
`state_dict`, `save_pretrained` and `.to()`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function

from .config import PerformerConfig
from .favor import causal_favor_attention, draw_projection, favor_attention

ATTN_IMPLEMENTATION = "performer"


class FavorAttention(nn.Module):
    """The FAVOR state of one converted attention layer: its settings and random projection.

    The projection is a persistent buffer of shape `(num_features, head_dim)`. Forward never redraws it, so
    evaluation is deterministic; `redraw` is an explicit call (made by the training loop every `redraw_interval`
    steps, or by `performer_hf.redraw_projections`).
    """

    def __init__(self, config: PerformerConfig, head_dim: int, generator: torch.Generator | None = None,
                 device=None):
        super().__init__()
        self.kernel = config.kernel
        self.num_features = config.num_features
        self.projection_kind = config.projection
        self.norms = config.norms
        self.chunk_size = config.chunk_size
        self.head_dim = head_dim
        self.register_buffer("projection", self._draw(generator, device))

    def _draw(self, generator, device):
        return draw_projection(self.num_features, self.head_dim, kind=self.projection_kind, norms=self.norms,
                               generator=generator, device=device, dtype=torch.float32)

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a fresh projection in place (same device and dtype as the current one)."""
        fresh = self._draw(generator, generator.device if generator is not None else self.projection.device)
        self.projection.copy_(fresh.to(self.projection.device))

    def forward(self, query, key, value, *, causal: bool, key_padding_mask=None, scale=None, state=None):
        """q (B, H, Lq, D), k and v (B, Hkv, Lk, D) -> (B, H, Lq, D) and, in causal mode, the new recurrent state."""
        if causal:
            return causal_favor_attention(
                query, key, value, projection=self.projection, kernel=self.kernel, chunk_size=self.chunk_size,
                key_padding_mask=key_padding_mask, scale=scale, state=state,
            )
        out = favor_attention(query, key, value, projection=self.projection, kernel=self.kernel,
                              key_padding_mask=key_padding_mask, scale=scale)
        return out, None

    def extra_repr(self) -> str:
        return (f"kernel={self.kernel!r}, num_features={self.num_features}, head_dim={self.head_dim}, "
                f"projection={self.projection_kind!r}/{self.norms!r}, chunk_size={self.chunk_size}")


def key_padding_from_mask(attention_mask: torch.Tensor | None, kv_length: int) -> torch.Tensor | None:
    """The (batch, kv_length) boolean padding mask (True = real key) from whatever mask reached the attention.

    Our mask function passes a 2D mask; a 4D mask (a user's custom mask, or one prepared elsewhere) is reduced to the
    keys that any query may see, which is exact for padding (+ causal) masks.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(
            attention_mask.dtype).min / 2
        attention_mask = allowed.any(dim=-2).any(dim=1)  # (B, Lk)
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    return None if bool(mask.all()) else mask


def performer_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The attention-interface function: (B, H, L, D) inputs -> ((B, L, H, D) output, None).

    Modules without a `performer` child (cross-attention, or layers left unconverted) keep exact attention.
    Attention dropout has no counterpart here: FAVOR never forms the attention matrix it would drop from.
    """
    favor = getattr(module, "performer", None)
    if not isinstance(favor, FavorAttention):
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask[:, None, None, :].to(torch.bool)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal
    mask = key_padding_from_mask(attention_mask, key.shape[2])
    layer = _cache_layer(favor, module) if causal else None
    out, state = favor(query, key, value, causal=causal, key_padding_mask=mask, scale=scaling,
                       state=None if layer is None else layer.state)
    if layer is not None:
        layer.state = state  # the recurrent state replaces the keys and values a softmax cache would keep
    return out.transpose(1, 2).contiguous(), None


def _cache_layer(favor: FavorAttention, module: nn.Module):
    """The `PerformerCache` layer of this module in the current call (see `generation`), or None."""
    cache = getattr(favor, "generation_cache", None)
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or layer_idx is None or layer_idx >= len(cache.layers):
        return None
    return cache.layers[layer_idx]


def performer_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask-interface function: a (batch, kv_length) boolean padding mask, or None when nothing is padded.

    Causality is the attention's own business (`module.is_causal`), so the pattern itself is never materialised.
    Sliding windows are not representable with global random features: a converted model attends to the whole
    prefix (the conversion warns). Other patterns (packed sequences, custom masks) are refused.
    """
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        config = kwargs.get("config")
        if getattr(config, "sliding_window", None) is None:
            raise ValueError(
                "FAVOR attention supports padding and causal masks only; this input asks for another pattern "
                "(packed sequences via position_ids, or a custom mask). Pass one sequence per row with an "
                "attention_mask instead."
            )
    if attention_mask is None:
        return None
    mask = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if mask.shape[-1] < kv_length:  # a mask shorter than the keys: the missing tail is real tokens
        mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]), value=True)
    return None if bool(mask.all()) else mask


def register() -> None:
    """Register the attention and mask functions under "performer" (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, performer_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, performer_mask)
