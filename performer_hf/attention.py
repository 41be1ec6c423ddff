"""FAVOR attention behind the transformers attention interface.

Converted models run with `config._attn_implementation == "performer"`. Two functions are registered under that
name: the attention function, which every supported model already calls with its own q, k, v (so Q/K/V layouts,
rotary embeddings and grouped heads stay the model's business), and a mask function, which hands the attention the
(batch, kv_length) padding mask instead of an O(L^2) boolean matrix. Each converted attention module owns a
`FavorAttention` child (attribute `performer`) with its projection as a buffer, so the projection travels with
`state_dict`, `save_pretrained` and `.to()`.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function

from .architectures import SELF_ATTENTION_CLASSES
from .config import PerformerConfig
from .favor import (
    causal_favor_attention,
    causal_local_attention,
    draw_projection,
    favor_attention,
    favor_plus_plus_a_from_moments,
    local_attention,
)
from .favor.kernel import repeat_heads

ATTN_IMPLEMENTATION = "performer"
_handed_over = threading.local()  # (layer_idx, cache layer) from PerformerCache.update to the attention call next


def tracing() -> bool:
    """Under torch.compile or torch.export: no Python branch may depend on a tensor's values (the fast paths that
    drop an all-True padding mask are skipped; the masked path gives the same answer)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def hand_over(layer_idx: int | None, layer) -> None:
    """Called by `PerformerCache.update`: the attention function of layer `layer_idx`, which the model calls right
    after updating its cache, continues `layer`'s recurrent state."""
    _handed_over.entry = (layer_idx, layer)


def _take_cache_layer(module: nn.Module):
    layer_idx, layer = getattr(_handed_over, "entry", (None, None))
    _handed_over.entry = (None, None)
    return layer if layer is not None and layer_idx == getattr(module, "layer_idx", None) else None


class FavorAttention(nn.Module):
    """The FAVOR state of one converted attention layer: its settings, projection and (FAVOR++) stored A.

    The projection, `(num_features, head_dim)` or per head `(num_heads, num_features, head_dim)`, is a persistent
    buffer, or a trainable parameter with `learned_features`. Forward never redraws it, so evaluation is
    deterministic; `redraw` is an explicit call (made by the training loop every `redraw_interval` steps, or by
    `performer_hf.redraw_projections`) and skips learned projections.

    `mode` is what a call does: "favor" (the Performer's attention), "calibrate" (exact attention, recording query
    and key statistics for FAVOR++'s A) or "transfer" (exact attention, recording in `transfer_loss` how far the
    FAVOR output on the same q, k, v is from it: attention transfer). The modes are set by `conversion.calibrate`
    and `training.attention_transfer`, never left on.
    """

    def __init__(self, config: PerformerConfig, head_dim: int, num_heads: int, generator: torch.Generator | None = None,
                 device=None):
        super().__init__()
        self.kernel = config.kernel
        self.num_features = config.num_features
        self.projection_kind = config.projection
        self.norms = config.norms
        self.chunk_size = config.chunk_size
        self.sink_tokens = config.sink_tokens or 0
        self.local_window = config.local_window or 0
        self.favor_beyond_window = config.favor_beyond_window
        self.learned = config.learned_features
        self.per_head = config.per_head_features
        self.head_dim, self.num_heads = head_dim, num_heads
        self.mode = "favor"
        self.transfer_loss: torch.Tensor | None = None
        self._moments: list | None = None
        projection = self._draw(generator, device)
        if self.learned:
            self.projection = nn.Parameter(projection)
        else:
            self.register_buffer("projection", projection)
        if config.feature_bias:  # hedgehog's biases, queries then keys: (2, m) or per head (2, H, m)
            self.feature_bias = nn.Parameter(torch.zeros(2, *projection.shape[:-1], device=device))
        if self.learned and self.is_local:  # per head, log-weight of the FAVOR terms against the exact ones
            self.favor_bias = nn.Parameter(torch.zeros(num_heads, device=device))
        if self.kernel == "favor++":  # filled by calibration at conversion, saved with the model
            self.register_buffer("favor_a", torch.full((num_heads,), float("nan"), device=device))

    def _draw(self, generator, device):
        draws = [draw_projection(self.num_features, self.head_dim, kind=self.projection_kind, norms=self.norms,
                                 generator=generator, device=device, dtype=torch.float32)
                 for _ in range(self.num_heads if self.per_head else 1)]
        return torch.stack(draws) if self.per_head else draws[0]  # (H, m, d) or (m, d)

    @property
    def is_local(self) -> bool:
        return bool(self.sink_tokens or self.local_window)

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> bool:
        """Draw a fresh projection in place (same device and dtype); learned projections are kept (returns False)."""
        if self.learned:
            return False
        fresh = self._draw(generator, generator.device if generator is not None else self.projection.device)
        self.projection.copy_(fresh.to(self.projection.device))
        return True

    def _favor_a(self):
        if self.kernel != "favor++":
            return None
        if not tracing() and bool(torch.isnan(self.favor_a).any()):
            raise ValueError("this favor++ layer has no calibrated A: convert with calibration inputs "
                             "(performer_hf.convert(model, kernel='favor++', calibration=batch))")
        return self.favor_a.unsqueeze(0)  # (1, H), broadcast over the batch

    def forward(self, query, key, value, *, causal: bool, key_padding_mask=None, scale=None, state=None):
        """q (B, H, Lq, D), k and v (B, Hkv, Lk, D) -> (B, H, Lq, D) and, in causal mode, the new recurrent state."""
        common = dict(projection=self.projection, kernel=self.kernel, key_padding_mask=key_padding_mask,
                      scale=scale, a=self._favor_a(), chunk_size=self.chunk_size,
                      feature_bias=getattr(self, "feature_bias", None))
        local = dict(sink_tokens=self.sink_tokens, local_window=self.local_window, favor=self.favor_beyond_window,
                     favor_bias=getattr(self, "favor_bias", None))
        if causal:
            if self.is_local:
                return causal_local_attention(query, key, value, state=state, **common, **local)
            return causal_favor_attention(query, key, value, state=state, **common)
        if self.is_local:
            return local_attention(query, key, value, **common, **local), None
        return favor_attention(query, key, value, **common), None

    def record_moments(self, query, key, key_padding_mask, scale) -> None:
        """Add this batch's scaled query/key statistics (real tokens only) to the calibration sums."""
        root = (query.shape[-1] ** -0.5 if scale is None else scale) ** 0.5
        rep = query.shape[1] // key.shape[1]
        q = query.double() * root
        k = repeat_heads(key, rep).double() * root
        w = torch.ones(q.shape[0], q.shape[2], dtype=q.dtype, device=q.device) if key_padding_mask is None else \
            key_padding_mask.to(q.dtype)
        w = w[:, None, :, None]  # (B, 1, L, 1)
        sums = [(x.pow(2).sum(-1, keepdim=True) * w).sum((0, 2)).squeeze(-1) for x in (q, k)]  # (H,) each
        means = [(x * w).sum((0, 2)) for x in (q, k)]  # (H, D) each
        batch = [sums[0], means[0], sums[1], means[1], w.sum()]
        self._moments = batch if self._moments is None else [a + b for a, b in zip(self._moments, batch, strict=True)]

    @torch.no_grad()
    def finish_calibration(self) -> None:
        if self._moments is None:
            raise ValueError("calibration saw no tokens in a converted layer; pass non-empty calibration inputs")
        q_sq, q_sum, k_sq, k_sum, count = self._moments
        a = favor_plus_plus_a_from_moments(q_sq / count, q_sum / count, k_sq / count, k_sum / count)
        self.favor_a.copy_(a.to(self.favor_a))
        self._moments = None

    def extra_repr(self) -> str:
        extra = f", sinks={self.sink_tokens}, window={self.local_window}" if self.is_local else ""
        extra += "" if self.favor_beyond_window else ", nothing beyond the window"
        extra += ", learned" if self.learned else ""
        extra += ", per-head" if self.per_head else ""
        extra += ", feature bias" if hasattr(self, "feature_bias") else ""
        return (f"kernel={self.kernel!r}, num_features={self.num_features}, head_dim={self.head_dim}, "
                f"projection={self.projection_kind!r}/{self.norms!r}, chunk_size={self.chunk_size}{extra}")


def exact_attention(query, key, value, *, causal: bool, key_padding_mask=None, scale=None) -> torch.Tensor:
    """Softmax attention on the same inputs (B, H, L, D), O(L^2): the target of calibration and attention transfer.
    Every query may at least see itself, so fully padded rows give finite (ignored) outputs."""
    rep = query.shape[1] // key.shape[1]
    key, value = repeat_heads(key, rep), repeat_heads(value, rep)
    lq, lk = query.shape[2], key.shape[2]
    if key_padding_mask is None and lq == lk:  # the fast fused paths
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=query.device)
    if causal:
        allowed = torch.tril(allowed, diagonal=lk - lq)
    allowed = allowed.expand(query.shape[0], 1, lq, lk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :].to(torch.bool)
    itself = torch.arange(lk, device=query.device) == torch.arange(lq, device=query.device).unsqueeze(-1) + lk - lq
    allowed = allowed | itself
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)


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
    return mask if tracing() or not bool(mask.all()) else None


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
    layer = _take_cache_layer(module)
    if not isinstance(favor, FavorAttention):
        if type(module).__name__ in SELF_ATTENTION_CLASSES and not getattr(module, "is_cross_attention", False):
            raise ValueError(
                f"{type(module).__name__} runs attn_implementation='performer' without a FAVOR module: this model "
                "was loaded without performer_hf (AutoModel...from_pretrained, pipeline(model=path) and "
                "SentenceTransformer(path) give the softmax model); load converted checkpoints with "
                "performer_hf.from_pretrained(path) (sentence-transformers: "
                "performer_hf.load_sentence_transformer(path))")
        if layer is not None:
            raise ValueError("a PerformerCache cannot serve a layer left with exact attention")
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask[:, None, None, :].to(torch.bool)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal
    mask = key_padding_from_mask(attention_mask, key.shape[2])
    if favor.mode != "favor":
        return _teacher_forced(favor, query, key, value, causal, mask, scaling)
    layer = layer if causal else None
    out, state = favor(query, key, value, causal=causal, key_padding_mask=mask, scale=scaling,
                       state=None if layer is None else layer.state)
    if layer is not None:
        layer.state = state  # the recurrent state replaces the keys and values a softmax cache would keep
    return out.transpose(1, 2).contiguous(), None


def _teacher_forced(favor: FavorAttention, query, key, value, causal, mask, scaling):
    """Calibration and attention transfer: the layer passes on exact attention (so every layer sees the original
    model's hidden states) and records what its mode asks for. Both the target and the estimate are computed in
    float32 at least, also under mixed precision (which then speeds up only the rest of the model)."""
    dtype = query.dtype
    if dtype in (torch.bfloat16, torch.float16):
        query, key, value = query.float(), key.float(), value.float()
    with torch.no_grad(), torch.autocast(query.device.type, enabled=False):
        exact = exact_attention(query, key, value, causal=causal, key_padding_mask=mask, scale=scaling)
    if favor.mode == "calibrate":
        favor.record_moments(query.detach(), key.detach(), mask, scaling)
    else:
        approx, _ = favor(query.detach(), key.detach(), value.detach(), causal=causal, key_padding_mask=mask,
                          scale=scaling)
        real = torch.ones(exact.shape[0], exact.shape[2], device=exact.device) if mask is None else mask.float()
        weights = real[:, None, :, None]  # (B, 1, L, 1); padded queries do not count
        err = ((approx.float() - exact.float()) ** 2 * weights).sum()
        norm = (exact.float() ** 2 * weights).sum().clamp_min(1e-12)
        loss = err / norm  # relative squared error of this layer's attention output
        favor.transfer_loss = loss if favor.transfer_loss is None else favor.transfer_loss + loss
    return exact.to(dtype).transpose(1, 2).contiguous(), None


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
            if tracing():
                raise ValueError(
                    "while tracing (torch.compile/export), position_ids without an attention_mask may be packed "
                    "sequences, which cannot be checked there and FAVOR attention does not support; pass an "
                    "attention_mask, or leave position_ids out")
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
    return mask if tracing() or not bool(mask.all()) else None


def register() -> None:
    """Register the attention and mask functions under "performer" (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, performer_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, performer_mask)
