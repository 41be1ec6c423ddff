"""Exact attention where softmax weights are spikiest, FAVOR for the rest, in one normaliser.

For query i the keys split into an exact set E_i and a FAVOR set F_i:

    E_i = the first `sink_tokens` real tokens (attention sinks, as in StreamingLLM) and the keys within
          `local_window` positions: causal j in (i - W, i]; bidirectional |i - j| < W
    F_i = every other real key the query may see
    out_i = (sum_{E_i} exp(q.k_j) v_j + sum_{F_i} phi(q).phi(k_j) v_j) / (the same with v = 1)

The exponential feature maps are unbiased estimates of exp(q.k) with their constants kept (1/m' included), so the two
sums are on one scale; each query row is stabilised by the largest log-term of either part. Nothing is O(L^2):

- causal: the FAVOR sums lag the window by W tokens. A block of C queries sees the W - 1 + C keys before and inside
  it exactly (masked C x (W - 1 + C) products) and everything older through the carried state; the C oldest keys of
  that range then fold into the state. Time O(L (W + C) (d + m)). The state (FAVOR sums, the last W - 1 keys and
  values, the S sink keys and values) is constant in the context length, and a call continues it exactly, so prefill
  followed by one-token steps equals one call on the whole sequence.
- bidirectional: the FAVOR sums over all keys minus the FAVOR terms of the band (the same feature values, so the
  difference is a sum of positive terms up to rounding; it is clamped at zero).

Sinks are the first S *real* tokens of each row (by rank among unpadded tokens), so left and right padding never
change the outputs of real tokens. The kernels that estimate exp(q.k) with its scale (favor+, hyperbolic, favor++) share
the normaliser as written above. A learned map whose features are normalised per token (hedgehog: `ANCHORED_KERNELS`)
has no such scale; its terms are anchored to the row instead, as LoLCATs combines a window with linear attention:

    phi(q_i).phi(k_j) is worth exp(a_i + b_h) phi(q_i).phi(k_j),  a_i = max over E_i of q.k_j

so that, divided by exp(a_i), the exact weights are exp(q.k_j - a_i) <= 1 and the far context is weighted by a learned
per-head exp(b_h) (`favor_bias`). a_i depends only on keys query i sees exactly: causal outputs stay prefix-invariant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .features import WINDOW_KERNELS
from .kernel import (
    FavorState,
    _accumulate,
    _check_inputs,
    _empty_state,
    _finite_or,
    _normalise,
    _prepare,
    _state_a,
    _values,
    full_precision,
    repeat_heads,
)


@dataclass
class LocalState:
    """The recurrent state of causal sink + window + FAVOR attention after a prefix.

    Attributes:
        favor (`FavorState`): FAVOR sums over the keys that have left the window (sinks and padding excluded).
        recent_k, recent_v (`(B, Hkv, W - 1, D)`): the last W - 1 keys and values, padding included.
        recent_real, recent_sink (`(B, W - 1)` bool): which of them are real tokens, and which are sinks.
        sink_k, sink_v (`(B, Hkv, S, D)`), sink_pos (`(B, S)` long), sink_valid (`(B, S)` bool): the sinks found so
            far, at their absolute positions.
        position (`int`): the absolute position of the next token (padding counts, as it does for positions).

    Its size depends on S, W and m, never on the number of tokens seen.
    """

    favor: FavorState
    recent_k: torch.Tensor
    recent_v: torch.Tensor
    recent_real: torch.Tensor
    recent_sink: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_pos: torch.Tensor
    sink_valid: torch.Tensor
    position: int = 0

    _TENSORS = ("recent_k", "recent_v", "recent_real", "recent_sink", "sink_k", "sink_v", "sink_pos", "sink_valid")

    def tensors(self) -> list[torch.Tensor]:
        return self.favor.tensors() + [getattr(self, name) for name in self._TENSORS]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map_tensors(self, fn) -> LocalState:
        """The same state with `fn` applied to every per-row tensor (beam reordering, batch expansion)."""
        return replace(self, favor=self.favor.map_tensors(fn), **{n: fn(getattr(self, n)) for n in self._TENSORS})


def check_local(kernel: str, sink_tokens: int, local_window: int) -> None:
    if (sink_tokens or local_window) and kernel not in WINDOW_KERNELS:
        raise ValueError(f"sink_tokens and local_window need a kernel that can share a normaliser with exact "
                         f"softmax weights ({', '.join(WINDOW_KERNELS)}); {kernel!r} cannot")


def _query_terms(fmap, q, favor_bias=None):
    """Query features as `(base, log_scale)` with phi(q) = base * exp(log_scale), the 1/m' of phi(q).phi(k)
    included in log_scale for the estimators of exp(q.k) (in plain FAVOR it cancels; here it must not), plus a
    per-head `favor_bias` (H,)."""
    q = fmap._scaled(q)
    u, offset = fmap.logits(q)  # (B, H, C, m'), (B, H, C)
    top = u.detach().amax(dim=-1)
    log_scale = top - offset
    if not fmap.anchored:
        log_scale = log_scale - math.log(u.shape[-1])
    if favor_bias is not None:
        log_scale = log_scale + favor_bias.to(log_scale.dtype)[:, None]
    return (u - top.unsqueeze(-1)).exp(), log_scale


def _row_anchor(exact_logits) -> torch.Tensor:
    """a_i: each query's largest exact logit (B, H, C); 0 for a row with none (only padded queries have none)."""
    anchor = None
    for logits in exact_logits:
        if logits.shape[-1]:
            top = logits.amax(dim=-1)
            anchor = top if anchor is None else torch.maximum(anchor, top)
    return _finite_or(anchor, 0.0)


def _combine(exact_logits, exact_v1, favor1, favor_log_scale, anchored=False):
    """Exact terms (lists of `(B, H, C, K)` logits, -inf where not allowed, and their `(B, H, K, Dv + 1)` values)
    plus FAVOR sums `favor1` (B, H, C, Dv + 1) worth exp(favor_log_scale) each, in one normaliser; `anchored`
    also multiplies the FAVOR terms by exp(a_i) (see the module docstring)."""
    if anchored:
        favor_log_scale = favor_log_scale + _row_anchor(exact_logits)
    favor_den = favor1[..., -1].clamp_min(0)
    favor_log = torch.where(favor_den > 0, favor_den.clamp_min(1e-30).log() + favor_log_scale, float("-inf"))
    top = favor_log
    for logits in exact_logits:
        if logits.shape[-1]:
            top = torch.maximum(top, logits.amax(dim=-1))
    top = _finite_or(top, 0.0).detach()  # (B, H, C): a stabiliser, cancels
    factor = torch.where(favor_den > 0, (favor_log_scale - top).clamp_max(80.0).exp(), 0.0)
    total = favor1 * factor.unsqueeze(-1)
    for logits, v1 in zip(exact_logits, exact_v1, strict=True):
        if logits.shape[-1]:
            total = total + (logits - top.unsqueeze(-1)).exp() @ v1
    return _normalise(total)


def _no_favor(q_c, v, dtype):
    """Empty FAVOR sums (B, H, C, Dv + 1) and their log-scale, for `favor=False`."""
    empty = torch.zeros(*q_c.shape[:3], v.shape[-1] + 1, dtype=dtype, device=q_c.device)
    return empty, empty[..., 0]


def _sink_ranks(real: torch.Tensor, already: torch.Tensor, sink_tokens: int):
    """Rank of each token among the real ones (continuing from `already` sinks seen) and whether it is a sink."""
    rank = already.unsqueeze(-1) + real.long().cumsum(dim=-1) - 1  # (B, L)
    return rank, real & (rank < sink_tokens)


def _exact_logits(fmap, q, k):
    """scale * q.k for every pair: (B, H, Lq, D) x (B, Hkv, Lk, D) -> (B, H, Lq, Lk)."""
    return fmap._scaled(q) @ repeat_heads(fmap._scaled(k), fmap.rep).transpose(-1, -2)


def _initial_state(fmap, q, k, v, window, sinks):
    batch, kv_heads, dim, dim_v = k.shape[0], k.shape[1], k.shape[-1], v.shape[-1]
    kv1, running_max = _empty_state(fmap, q, v)
    lag = max(window - 1, 0)
    zeros = lambda *shape: torch.zeros(*shape, dtype=fmap.dtype, device=q.device)  # noqa: E731
    falses = lambda *shape: torch.zeros(*shape, dtype=torch.bool, device=q.device)  # noqa: E731
    return LocalState(FavorState(kv1, running_max), zeros(batch, kv_heads, lag, dim),
                      zeros(batch, kv_heads, lag, dim_v), falses(batch, lag), falses(batch, lag),
                      zeros(batch, kv_heads, sinks, dim), zeros(batch, kv_heads, sinks, dim_v),
                      torch.zeros(batch, sinks, dtype=torch.long, device=q.device), falses(batch, sinks), 0)


@full_precision
def causal_local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    projection: torch.Tensor,
    kernel: str = "favor+",
    sink_tokens: int = 4,
    local_window: int = 128,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    a: torch.Tensor | float | None = None,
    state: LocalState | None = None,
    favor: bool = True,
    favor_bias: torch.Tensor | None = None,
    feature_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LocalState]:
    """Causal sink + window + FAVOR attention continuing from `state`; returns the output and the new state.

    Arguments as in `causal_favor_attention`, plus `sink_tokens` (S) and `local_window` (W). With S + W at least
    the sequence length this is exact causal softmax attention. `favor=False` drops the keys beyond the sinks and
    the window instead (StreamingLLM's attention; for comparison). `favor_bias` (H,) adds a per-head log-weight to
    every FAVOR term (learned: how much a head trusts its estimate of the far context); `feature_bias` as in
    `favor_attention`.
    """
    _check_inputs(q, k, v, projection, kernel, key_padding_mask, feature_bias)
    check_local(kernel, sink_tokens, local_window)
    if q.shape[2] != k.shape[2]:
        if q.shape[2] > k.shape[2]:
            raise ValueError(f"causal attention needs at least as many keys as queries, got {q.shape[2]} queries "
                             f"and {k.shape[2]} keys")
        # a softmax-style cache handed us every key: fold the earlier ones into a state first
        prefix = k.shape[2] - q.shape[2]
        masks = (None, None) if key_padding_mask is None else (key_padding_mask[:, :prefix],
                                                                key_padding_mask[:, prefix:])
        _, state = causal_local_attention(
            repeat_heads(k[:, :, :prefix], q.shape[1] // k.shape[1]), k[:, :, :prefix], v[:, :, :prefix],
            projection=projection, kernel=kernel, sink_tokens=sink_tokens, local_window=local_window,
            key_padding_mask=masks[0], chunk_size=chunk_size, scale=scale, a=a, state=state, favor=favor,
            favor_bias=favor_bias, feature_bias=feature_bias)
        k, v, key_padding_mask = k[:, :, prefix:], v[:, :, prefix:], masks[1]
    if state is not None and state.favor.a is not None:
        a = state.favor.a
    fmap, mask = _prepare(q, k, projection, kernel, scale, key_padding_mask, a, feature_bias)
    state = state or _initial_state(fmap, q, k, v, local_window, sink_tokens)
    batch, length = q.shape[0], q.shape[2]
    real = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask[:, 0]
    lag = max(local_window - 1, 0)
    positions = state.position + torch.arange(length, device=q.device)  # (L,)

    # sinks: the first S real tokens of each row, wherever they fall
    sink_k, sink_v, sink_pos, sink_valid = state.sink_k, state.sink_v, state.sink_pos, state.sink_valid
    if sink_tokens:
        rank, is_sink = _sink_ranks(real, sink_valid.sum(-1), sink_tokens)
        slots = (rank.unsqueeze(-1) == torch.arange(sink_tokens, device=q.device)) & is_sink.unsqueeze(-1)  # (B,L,S)
        onehot = slots.to(fmap.dtype)
        sink_k = sink_k + torch.einsum("bhld,bls->bhsd", k.to(fmap.dtype), onehot)
        sink_v = sink_v + torch.einsum("bhld,bls->bhsd", v.to(fmap.dtype), onehot)
        sink_pos = sink_pos + (slots.long() * positions.view(1, -1, 1)).sum(1)
        sink_valid = sink_valid | slots.any(1)
    else:
        is_sink = torch.zeros_like(real)
    sink_v1 = _values(sink_v, fmap.rep, fmap.dtype)  # (B, H, S, Dv + 1)

    # keys with the W - 1 before them; query t sees keys [t, t + lag] of these within the window
    all_k = torch.cat([state.recent_k.to(k.dtype), k], dim=2)
    all_v = torch.cat([state.recent_v.to(v.dtype), v], dim=2)
    all_real = torch.cat([state.recent_real, real], dim=1)
    favor_ok = all_real & ~torch.cat([state.recent_sink, is_sink], dim=1)  # keys FAVOR may count
    kv1, running_max = state.favor.kv.to(fmap.dtype), state.favor.max_log_scale.to(fmap.dtype)
    outputs = []
    for start in range(0, length, chunk_size):
        c = min(chunk_size, length - start)
        span = slice(start, start + lag + c)
        q_c = q[:, :, start : start + c]
        i = torch.arange(c, device=q.device).unsqueeze(-1)  # query index in the block
        r = torch.arange(lag + c, device=q.device).unsqueeze(0)  # key index in the span
        # window: key r is i + lag - r positions before query i
        in_window = (r > i + lag - local_window) & (r <= i + lag) & all_real[:, None, span]  # (B, C, lag + c)
        win_logits = _exact_logits(fmap, q_c, all_k[:, :, span]).masked_fill(~in_window[:, None], float("-inf"))
        exact, values = [win_logits], [_values(all_v[:, :, span], fmap.rep, fmap.dtype)]
        if sink_tokens:
            q_pos = positions[start : start + c]
            visible = sink_valid[:, None, :] & (sink_pos[:, None, :] <= q_pos.view(1, -1, 1) - local_window)
            exact.append(_exact_logits(fmap, q_c, sink_k).masked_fill(~visible[:, None], float("-inf")))
            values.append(sink_v1)
        # FAVOR: the state holds keys at least W before the block; the span's first c keys leave the window
        # during the block (key r < c counts for query i when r <= i + lag - W) and fold in afterwards
        if not favor:
            outputs.append(_combine(exact, values, *_no_favor(q_c, v, fmap.dtype)))
            continue
        q_base, q_log = _query_terms(fmap, q_c, favor_bias)
        leaving = slice(start, start + c)
        u, offset, log_scale = fmap.keys(all_k[:, :, leaving], favor_ok[:, None, leaving])
        new_max = torch.maximum(running_max, log_scale.amax(dim=-1))  # (B, H)
        safe_max = _finite_or(new_max, 0.0)
        kv1 = kv1 * (_finite_or(running_max, safe_max) - safe_max).exp()[..., None, None]
        k_feat = fmap.stabilised(u, offset, safe_max)  # (B, H or Hkv, c, m')
        v1 = _values(all_v[:, :, leaving], fmap.key_rep, fmap.dtype)
        scores = torch.tril(fmap.times_sums(q_base, k_feat.transpose(-1, -2)), diagonal=lag - local_window)
        favor1 = fmap.times_sums(scores, v1) + fmap.times_sums(q_base, kv1)  # (B, H, c, Dv + 1)
        outputs.append(_combine(exact, values, favor1, q_log + fmap.per_query_head(safe_max).unsqueeze(-1),
                                    anchored=fmap.anchored))
        kv1, running_max = kv1 + k_feat.transpose(-1, -2) @ v1, new_max
    out = torch.cat(outputs, dim=2) if outputs else q.new_zeros(*q.shape[:3], v.shape[-1])
    keep = slice(all_k.shape[2] - lag, all_k.shape[2])
    new_state = LocalState(
        FavorState(kv1, running_max, _state_a(fmap, q)), all_k[:, :, keep].to(fmap.dtype),
        all_v[:, :, keep].to(fmap.dtype), all_real[:, keep], torch.cat([state.recent_sink, is_sink], dim=1)[:, keep],
        sink_k, sink_v, sink_pos, sink_valid, state.position + length)
    return out.to(q.dtype), new_state


@full_precision
def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    projection: torch.Tensor,
    kernel: str = "favor+",
    sink_tokens: int = 0,
    local_window: int = 64,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    a: torch.Tensor | float | None = None,
    favor: bool = True,
    favor_bias: torch.Tensor | None = None,
    feature_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional sink + band + FAVOR attention (self-attention: Lq == Lk). Exact weights for the first
    `sink_tokens` real tokens and for keys with |i - j| < `local_window`; FAVOR for the rest (dropped with
    `favor=False`, for comparison)."""
    _check_inputs(q, k, v, projection, kernel, key_padding_mask, feature_bias)
    check_local(kernel, sink_tokens, local_window)
    if q.shape[2] != k.shape[2]:
        raise ValueError("local attention is self-attention: queries and keys must have the same length")
    fmap, mask = _prepare(q, k, projection, kernel, scale, key_padding_mask, a, feature_bias)
    batch, length = q.shape[0], q.shape[2]
    real = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask[:, 0]
    _, is_sink = _sink_ranks(real, torch.zeros(batch, dtype=torch.long, device=q.device), sink_tokens)
    favor_ok = real & ~is_sink
    if favor:
        kv1, running_max = _empty_state(fmap, q, v)
        kv1, running_max, _ = _accumulate(fmap, k, v, favor_ok[:, None], kv1, running_max)
        safe_max = _finite_or(running_max, 0.0)
    sink_idx = torch.sort((~is_sink).to(torch.int8), dim=1, stable=True).indices[:, :sink_tokens]  # (B, S)
    sink_valid = is_sink.gather(1, sink_idx)
    gather = lambda x: x.gather(2, sink_idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))  # noqa: E731
    sink_k, sink_v1 = gather(k), _values(gather(v), fmap.rep, fmap.dtype)
    reach = max(local_window - 1, 0)
    outputs = []
    for start in range(0, length, chunk_size):
        c = min(chunk_size, length - start)
        lo, hi = max(0, start - reach), min(length, start + c + reach)
        q_c = q[:, :, start : start + c]
        i = torch.arange(start, start + c, device=q.device).unsqueeze(-1)
        j = torch.arange(lo, hi, device=q.device).unsqueeze(0)
        band = ((i - j).abs() < local_window) & real[:, None, lo:hi]  # (B, c, hi - lo)
        band_logits = _exact_logits(fmap, q_c, k[:, :, lo:hi]).masked_fill(~band[:, None], float("-inf"))
        exact, values = [band_logits], [_values(v[:, :, lo:hi], fmap.rep, fmap.dtype)]
        if sink_tokens:
            visible = sink_valid[:, None, :] & ((i.unsqueeze(0) - sink_idx[:, None, :]).abs() >= local_window)
            exact.append(_exact_logits(fmap, q_c, sink_k).masked_fill(~visible[:, None], float("-inf")))
            values.append(sink_v1)
        if not favor:
            outputs.append(_combine(exact, values, *_no_favor(q_c, v, fmap.dtype)))
            continue
        q_base, q_log = _query_terms(fmap, q_c, favor_bias)
        u, offset, _ = fmap.keys(k[:, :, lo:hi], (favor_ok[:, lo:hi])[:, None])
        k_feat = fmap.stabilised(u, offset, safe_max)  # (B, H or Hkv, hi - lo, m')
        in_band = (band & favor_ok[:, None, lo:hi]).to(fmap.dtype)[:, None]
        band_favor = (fmap.times_sums(q_base, k_feat.transpose(-1, -2)) * in_band) @ values[0]
        favor1 = fmap.times_sums(q_base, kv1) - band_favor  # the band's FAVOR terms taken out of the total
        favor1 = torch.where(favor1[..., -1:] > 0, favor1, 0.0)
        outputs.append(_combine(exact, values, favor1, q_log + fmap.per_query_head(safe_max).unsqueeze(-1),
                                    anchored=fmap.anchored))
    return torch.cat(outputs, dim=2).to(q.dtype)
