"""FAVOR attention: softmax attention approximated with random features in O(L) time and memory.

    out_i = sum_j phi(q_i) . phi(k_j) v_j / sum_j phi(q_i) . phi(k_j)

computed as phi(Q) (phi(K)^T V) and phi(Q) (phi(K)^T 1), never forming the (Lq, Lk) matrix outside a causal chunk.

Numerics: feature maps and sums run in float32 (float64 stays float64) whatever the input dtype, and the output is cast
back; autocast (`--mixed-precision`) is switched off inside, or it would run the feature matmuls in bf16/fp16 anyway.
Each feature row is split into a bounded base and a log scale (see `features`): a query row's scale cancels between
numerator and denominator, and keys are stabilised by subtracting the maximum log scale over the real keys (features
and sequence), a constant that cancels too. Padded keys get zero features, so they count neither in the numerator nor
in the normaliser. In the causal form the key maximum is a running one, carried with the state and rescaled as it
grows, so results never depend on future tokens and a one-token step is the same computation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .features import (
    ANCHORED_KERNELS,
    EXP_KERNELS,
    KERNELS,
    exp_logits,
    favor_plus_plus_a,
    feature_map,
    hedgehog_logits,
)


@dataclass
class FavorState:
    """The recurrent state of causal FAVOR attention after some prefix of tokens.

    Attributes:
        kv (`torch.Tensor` of shape `(B, H, m', Dv + 1)`): sum over the prefix of phi(k_j) [v_j, 1]^T, stabilised;
            the last column is the normaliser sum phi(k_j).
        max_log_scale (`torch.Tensor` of shape `(B, H)`): the running key stabiliser; `kv` is scaled by
            exp(-max_log_scale). -inf while no real key has been seen.
        a (`torch.Tensor` of shape `(B, H)`, *optional*): FAVOR++'s A, fixed when the state was started.

    Its size is independent of the number of tokens seen.
    """

    kv: torch.Tensor
    max_log_scale: torch.Tensor
    a: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.kv, self.max_log_scale, self.a) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map_tensors(self, fn) -> FavorState:
        """The same state with `fn` applied to each per-row tensor (beam reordering, batch expansion)."""
        return FavorState(fn(self.kv), fn(self.max_log_scale), None if self.a is None else fn(self.a))

    def index_select(self, batch_index: torch.Tensor) -> FavorState:
        """The state of the chosen batch rows (beam search reordering)."""
        return self.map_tensors(lambda t: t.index_select(0, batch_index.to(t.device)))


def repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hkv * rep, ...): each key/value head once per query head it serves."""
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def full_precision(attention):
    """Run `attention(q, ...)` with autocast off for q's device: its casts to the compute dtype must hold (under
    autocast every matmul would run in bf16/fp16 whatever its inputs, and exponentiated features lose digits)."""

    @functools.wraps(attention)
    def wrapper(q, *args, **kwargs):
        if not torch.is_autocast_enabled(q.device.type):
            return attention(q, *args, **kwargs)
        with torch.autocast(q.device.type, enabled=False):
            return attention(q, *args, **kwargs)

    return wrapper


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_inputs(q, k, v, projection, kernel, key_padding_mask, feature_bias=None):
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, length, dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k, v shapes do not match: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads")
    if projection.dim() not in (2, 3) or projection.shape[-1] != q.shape[-1] or (
            projection.dim() == 3 and projection.shape[0] != q.shape[1]):
        raise ValueError(f"projection must be (num_features, {q.shape[-1]}) or per head ({q.shape[1]}, num_features, "
                         f"{q.shape[-1]}), got {tuple(projection.shape)}")
    if feature_bias is not None and kernel != "hedgehog":
        raise ValueError(f"feature_bias belongs to the learned hedgehog map, not to kernel {kernel!r}")
    if feature_bias is not None and feature_bias.shape != (2, *projection.shape[:-1]):
        raise ValueError(f"feature_bias must be (2, {', '.join(map(str, projection.shape[:-1]))}) (query and key "
                         f"biases of the hedgehog map for this projection), got {tuple(feature_bias.shape)}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"key_padding_mask must be (batch, key length) = {(k.shape[0], k.shape[2])}, "
                         f"got {tuple(key_padding_mask.shape)}")


class _ShiftedExp(torch.autograd.Function):
    """exp(u - shift[..., None]), in place on u. Autograd's own backward would first write -grad over the whole
    (L, m') tensor to send gradient to `shift`; here that gradient is a single reduction."""

    @staticmethod
    def forward(ctx, u, shift):
        out = u.sub_(shift.unsqueeze(-1)).exp_()
        ctx.mark_dirty(u)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        grad_u = grad * out
        grad_shift = -grad_u.sum(dim=-1) if ctx.needs_input_grad[1] else None
        return grad_u, grad_shift


def _shifted_exp(u: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (u.requires_grad or shift.requires_grad):
        return _ShiftedExp.apply(u, shift)
    return u.sub_(shift.unsqueeze(-1)).exp_()


class _FeatureMap:
    """The feature map of one attention call, applied block by block in the compute dtype.

    Query rows are exp(u - max_f u) (their scale cancels). Keys are kept as `(u, offset)` with
    phi(k_j) ~ exp(u_j - offset_j) for the exponential kernels and u_j * exp(-offset_j) for the others, so that the
    stabiliser can be subtracted before anything is exponentiated. Working on blocks of a few MB keeps large
    temporaries out of the allocator (on CPU a fresh 200 MB tensor costs more in page faults than the exp itself).
    """

    def __init__(self, projection, kernel, root, dtype, rep, a, bias=None):
        # x @ projection.T runs about twice as fast on CPU when projection.T is contiguous
        self.projection = projection.to(dtype=dtype).mT.contiguous().mT
        self.kernel, self.root, self.dtype, self.rep, self.a = kernel, root, dtype, rep, a
        self.bias = (None, None) if bias is None else tuple(bias.to(dtype))  # hedgehog's query and key biases
        self.exp_family = kernel in EXP_KERNELS
        self.anchored = kernel in ANCHORED_KERNELS  # beside exact weights: far terms scaled by the row's top logit
        # Grouped-query attention with one projection and no per-head A: the `rep` query heads of a key/value head
        # see the same key features, so keys, the running sums and the state stay per key/value head (rep x less)
        self.shares_keys = rep > 1 and a is None and projection.dim() == 2
        self.key_rep = 1 if self.shares_keys else rep  # how often keys and values are repeated for the FAVOR sums

    def _scaled(self, x, is_key=False):
        x = x.to(self.dtype) * self.root
        return repeat_heads(x, self.key_rep) if is_key else x

    def times_sums(self, q_feat: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        """A per-query-head (B, H, C, K) tensor (query features, or block scores) times a key-side (B, H or Hkv, K, X)
        one (key features, values, or the running sums) -> (B, H, C, X)."""
        if not self.shares_keys:
            return q_feat @ sums
        grouped = q_feat.unflatten(1, (q_feat.shape[1] // self.rep, self.rep))  # (B, Hkv, rep, C, K)
        return (grouped @ sums.unsqueeze(2)).flatten(1, 2)

    def per_query_head(self, x: torch.Tensor) -> torch.Tensor:
        """A key-side (B, Hkv, ...) statistic for every query head (no-op when keys are already per query head)."""
        return repeat_heads(x, self.rep) if self.shares_keys else x

    def logits(self, x: torch.Tensor, is_key: bool = False):
        """`exp_logits` of already scaled queries or keys, with their own bias."""
        return exp_logits(x, self.projection, self.kernel, self.a, self.bias[is_key])

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        q = self._scaled(q)
        if not self.exp_family:
            return feature_map(q, self.projection, self.kernel)[0]
        if self.kernel == "hedgehog":  # the per-token normaliser cancels: no log-sum-exp
            u = hedgehog_logits(q, self.projection, self.bias[0])
        else:
            u, _ = self.logits(q)  # (B, H, C, m')
        return _shifted_exp(u, u.detach().amax(dim=-1))

    def normalised_keys(self, k: torch.Tensor, mask: torch.Tensor | None):
        """hedgehog: `(phi(k), log_scale)` with phi(k) one fused softmax over features, bounded by one, so no
        stabiliser is needed: log_scale is 0 for real keys and -inf for padding (whose features are zero)."""
        k = self._scaled(k, is_key=True)
        features = torch.softmax(hedgehog_logits(k, self.projection, self.bias[1]), dim=-1)  # (B, H, C, 2m)
        log_scale = features.new_zeros(features.shape[:-1])
        if mask is not None:
            features = features.masked_fill(~mask.unsqueeze(-1), 0.0)
            log_scale = log_scale.masked_fill(~mask, float("-inf"))
        return features, log_scale

    def keys(self, k: torch.Tensor, mask: torch.Tensor | None):
        """`(u, offset, log_scale)`: log_scale = max_f log phi(k_j), -inf for padding, whose offset is +inf."""
        k = self._scaled(k, is_key=True)
        if self.exp_family:
            u, offset = self.logits(k, is_key=True)  # (B, H, C, m'), (B, H, C)
            log_scale = u.detach().amax(dim=-1) - offset.detach()
        else:
            u, log_scale = feature_map(k, self.projection, self.kernel)
            offset, log_scale = -log_scale, log_scale.detach()
        if mask is not None:
            log_scale = log_scale.masked_fill(~mask, float("-inf"))
            offset = offset.masked_fill(~mask, float("inf"))  # padded keys become exact zeros below
        return u, offset, log_scale

    def stabilised(self, u, offset, stabiliser):
        """Key features scaled by exp(-stabiliser) (B, H)."""
        shift = offset + stabiliser.unsqueeze(-1)  # (B, H, C)
        if self.exp_family:
            return _shifted_exp(u, shift)
        scale = torch.where(torch.isinf(shift), 0.0, (-shift).exp())  # relu's eps must not survive on padding
        return u * scale.unsqueeze(-1)


def _prepare(q, k, projection, kernel, scale, key_padding_mask, a, feature_bias=None):
    """Check shapes, pick the compute dtype and FAVOR++'s A; return the feature map and the (B, 1, Lk) mask."""
    cdtype = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    root = math.sqrt(scale)  # exp(scale q.k) = exp(q~ . k~) with q~ = sqrt(scale) q, k~ = sqrt(scale) k
    rep = q.shape[1] // k.shape[1]  # grouped-query attention: each key/value head serves `rep` query heads
    mask = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.bool)[:, None, :]
    if kernel == "favor++" and a is None:
        qs, ks = q.to(cdtype) * root, k.to(cdtype) * root
        ks = repeat_heads(ks, rep)
        # self-attention (Lq == Lk): padded queries are the padded keys, and stay out of the statistics too
        q_mask = mask if mask is not None and q.shape[2] == k.shape[2] else None
        a = favor_plus_plus_a(qs, ks, q_mask, mask)
    bias = None if feature_bias is None else feature_bias.to(q.device)
    return _FeatureMap(projection.to(q.device), kernel, root, cdtype, rep, a, bias), mask


def _values(v, rep, dtype):
    """Values with a column of ones: one matmul then gives both the numerator and the normaliser."""
    v = repeat_heads(v, rep)
    return torch.cat([v.to(dtype), torch.ones_like(v[..., :1], dtype=dtype)], dim=-1)  # (B, H, C, Dv + 1)


def _finite_or(x: torch.Tensor, fallback: torch.Tensor | float) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, fallback)


def _normalise(out1: torch.Tensor) -> torch.Tensor:
    """Split (..., Dv + 1) into numerator / normaliser. A query that sees no real key gets 0, never NaN."""
    denominator = out1[..., -1:]
    return out1[..., :-1] / torch.where(denominator == 0, 1.0, denominator)


def _accumulate(fmap, k_c, v_c, mask_c, kv1, running_max, causal_q=None):
    """Add one block of keys to the running sums (rescaled to the new key maximum).

    With `causal_q` (the block's query features), also return the block's causal outputs.
    """
    k_feat = None
    if fmap.kernel == "hedgehog":
        k_feat, log_scale = fmap.normalised_keys(k_c, mask_c)  # bounded: the maximum stays 0 (or -inf)
    else:
        u, offset, log_scale = fmap.keys(k_c, mask_c)
    new_max = torch.maximum(running_max, log_scale.amax(dim=-1))  # (B, H)
    safe_max = _finite_or(new_max, 0.0)
    rescale = (_finite_or(running_max, safe_max) - safe_max).exp()  # shrink the carried sums to the new max
    if k_feat is None:
        k_feat = fmap.stabilised(u, offset, safe_max)  # (B, H or Hkv, C, m')
    v1 = _values(v_c, fmap.key_rep, fmap.dtype)  # (B, H or Hkv, C, Dv + 1)
    kv1 = kv1 * rescale[..., None, None]
    out = None
    if causal_q is not None:
        scores = torch.tril(fmap.times_sums(causal_q, k_feat.transpose(-1, -2)))  # (B, H, C, C), within the block
        out = _normalise(fmap.times_sums(scores, v1) + fmap.times_sums(causal_q, kv1))  # (B, H, C, Dv)
    return kv1 + k_feat.transpose(-1, -2) @ v1, new_max, out



def _blocks(tensors, size: int):
    """Split along the sequence once (`torch.split`): slicing a tensor that needs gradients inside the loop would
    make every block's backward allocate a full-length gradient, quadratic in the length."""
    first = next(t for t in tensors if t is not None)
    count = -(-first.shape[2] // size) if first.shape[2] else 0
    return [t.split(size, dim=-1 if t.dim() == 3 else 2) if t is not None else [None] * count for t in tensors]


def _block_size(rows: int, features: int) -> int:
    """Tokens per block so that a block of features is about 16 MB."""
    return max(64, (1 << 22) // max(1, rows * features))


def _state_a(fmap, q) -> torch.Tensor | None:
    """FAVOR++'s A as the (B, H) tensor a state carries (None for the other kernels)."""
    if fmap.a is None:
        return None
    return torch.as_tensor(fmap.a, dtype=fmap.dtype, device=q.device).expand(q.shape[0], q.shape[1])


def _empty_state(fmap, q, v):
    batch, heads = q.shape[0], q.shape[1] // (fmap.rep if fmap.shares_keys else 1)
    num_feat = fmap.projection.shape[-2] * (1 if fmap.kernel in ("favor+", "favor++", "relu") else 2)
    kv1 = torch.zeros(batch, heads, num_feat, v.shape[-1] + 1, dtype=fmap.dtype, device=q.device)
    return kv1, torch.full((batch, heads), float("-inf"), dtype=fmap.dtype, device=q.device)


@full_precision
def favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    projection: torch.Tensor,
    kernel: str = "favor+",
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    a: torch.Tensor | float | None = None,
    feature_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Random-feature approximation of `softmax(scale * q k^T) v`.

    Args:
        q (`torch.Tensor` of shape `(B, H, Lq, D)`), k (`(B, Hkv, Lk, D)`), v (`(B, Hkv, Lk, Dv)`):
            Queries, keys and values; Hkv may divide H (grouped-query attention).
        projection (`torch.Tensor` of shape `(m, D)` or `(H, m, D)`): random projection from `draw_projection`,
            shared by the heads or one per head.
        kernel (`str`, *optional*, defaults to `"favor+"`): `"favor+"`, `"hyperbolic"`, `"favor++"`,
            `"hedgehog"` (learned), `"trig"` (comparison only) or `"relu"` (generalized attention, its own kernel).
        causal (`bool`, *optional*, defaults to `False`): token i attends to keys 0..i (needs Lq == Lk).
        key_padding_mask (`torch.Tensor` of shape `(B, Lk)`, *optional*): True for real tokens, False for padding.
        chunk_size (`int`, *optional*, defaults to 64): tokens per block of the causal form.
        scale (`float`, *optional*): softmax temperature, defaults to 1/sqrt(D).
        a (`float` or `torch.Tensor` of shape `(B, H)`, *optional*): FAVOR++'s A; by default computed from the
            statistics of the real tokens of this q and k (in causal mode this uses the whole sequence).
        feature_bias (`torch.Tensor` of shape `(2, m)` or `(2, H, m)`, *optional*): the hedgehog map's learned
            biases, for queries then keys.

    Returns:
        `torch.Tensor` of shape `(B, H, Lq, Dv)` in the dtype of `q`.

    Example:
        >>> q = k = v = torch.randn(1, 2, 10, 16)
        >>> w = draw_projection(64, 16, generator=torch.Generator().manual_seed(0))
        >>> favor_attention(q, k, v, projection=w).shape
        torch.Size([1, 2, 10, 16])
    """
    _check_inputs(q, k, v, projection, kernel, key_padding_mask, feature_bias)
    if causal:
        out, _ = causal_favor_attention(
            q, k, v, projection=projection, kernel=kernel, key_padding_mask=key_padding_mask,
            chunk_size=chunk_size, scale=scale, a=a, feature_bias=feature_bias,
        )
        return out
    fmap, mask = _prepare(q, k, projection, kernel, scale, key_padding_mask, a, feature_bias)
    kv1, running_max = _empty_state(fmap, q, v)
    block = _block_size(q.shape[0] * q.shape[1], fmap.projection.shape[-2])
    for k_c, v_c, mask_c in zip(*_blocks((k, v, mask), block), strict=True):
        kv1, running_max, _ = _accumulate(fmap, k_c, v_c, mask_c, kv1, running_max)
    # kv1 is now relative to the maximum over all real keys; any common scale cancels in the quotient
    outputs = [_normalise(fmap.times_sums(fmap.queries(q_c), kv1)) for q_c in q.split(block, dim=2)]
    return torch.cat(outputs, dim=2).to(q.dtype)  # (B, H, Lq, Dv)


@full_precision
def causal_favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    projection: torch.Tensor,
    kernel: str = "favor+",
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    a: torch.Tensor | float | None = None,
    state: FavorState | None = None,
    feature_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FavorState]:
    """Causal FAVOR attention continuing from `state` (None: from the start); returns the output and the new state.

    Within a chunk of `chunk_size` tokens the masked (C, C) product is used; across chunks the prefix sums
    sum phi(k) [v, 1]^T are carried. Time O(L C m + L m Dv), memory O(L Dv + C m + m Dv): no per-token (m, Dv) tensor
    is ever formed. A call with one token is the recurrent generation step; prefill followed by steps equals one call
    on the whole sequence. Arguments as in `favor_attention`; `a` is ignored when `state` already carries one.
    """
    _check_inputs(q, k, v, projection, kernel, key_padding_mask, feature_bias)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs at least as many keys as queries, got {q.shape[2]} queries and "
                         f"{k.shape[2]} keys")
    if q.shape[2] < k.shape[2]:
        # the queries are the last tokens (a softmax-style cache handed us all keys): fold the others into a state
        prefix = k.shape[2] - q.shape[2]
        rep = q.shape[1] // k.shape[1]
        as_queries = repeat_heads(k[:, :, :prefix], rep)
        masks = (None, None) if key_padding_mask is None else (key_padding_mask[:, :prefix],
                                                                key_padding_mask[:, prefix:])
        _, state = causal_favor_attention(as_queries, k[:, :, :prefix], v[:, :, :prefix], projection=projection,
                                          kernel=kernel, key_padding_mask=masks[0], chunk_size=chunk_size,
                                          scale=scale, a=a, state=state, feature_bias=feature_bias)
        k, v, key_padding_mask = k[:, :, prefix:], v[:, :, prefix:], masks[1]
    if state is not None and state.a is not None:
        a = state.a
    fmap, mask = _prepare(q, k, projection, kernel, scale, key_padding_mask, a, feature_bias)
    if state is None:
        kv1, running_max = _empty_state(fmap, q, v)
    else:
        kv1, running_max = state.kv.to(fmap.dtype), state.max_log_scale.to(fmap.dtype)
    outputs = []
    for q_c, k_c, v_c, mask_c in zip(*_blocks((q, k, v, mask), chunk_size), strict=True):
        kv1, running_max, out = _accumulate(fmap, k_c, v_c, mask_c, kv1, running_max, causal_q=fmap.queries(q_c))
        outputs.append(out)
    out = torch.cat(outputs, dim=2) if outputs else q.new_zeros(*q.shape[:3], v.shape[-1])
    return out.to(q.dtype), FavorState(kv1, running_max, _state_a(fmap, q))


def favor_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: FavorState | None,
    *,
    projection: torch.Tensor,
    kernel: str = "favor+",
    scale: float | None = None,
    feature_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FavorState]:
    """One recurrent step of causal FAVOR attention: q, k, v of shape (B, H, 1, D); O(m Dv) work and memory."""
    if q.shape[2] != 1:
        raise ValueError(f"favor_step takes one token at a time, got {q.shape[2]}")
    return causal_favor_attention(q, k, v, projection=projection, kernel=kernel, scale=scale, state=state,
                                  feature_bias=feature_bias)
