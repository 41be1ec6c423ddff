"""Sinks + exact local window + FAVOR for the rest: against an O(L^2) float64 reference."""

import math

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from performer_hf.favor import causal_local_attention, draw_projection, local_attention


def qkv(batch=2, heads=4, kv_heads=2, length=37, dim=8, norm=1.5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=g, dtype=dtype) * norm
    k = torch.randn(batch, kv_heads, length, dim, generator=g, dtype=dtype) * norm
    v = torch.randn(batch, kv_heads, length, dim, generator=g, dtype=dtype)
    return q, k, v


def projection(m=16, dim=8, seed=0, dtype=torch.float64):
    return draw_projection(m, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def key_sets(mask, sinks, window, causal):
    """(B, L, L) masks of the keys each query sees exactly (sinks, window) and through the feature map."""
    length = mask.shape[-1]
    rank = mask.long().cumsum(-1) - 1
    is_sink = mask & (rank < sinks)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    visible = j <= i if causal else torch.ones(length, length, dtype=torch.bool)
    band = (j > i - window) & visible if causal else (i - j).abs() < window
    in_exact = (band[None] | is_sink[:, None, :]) & visible[None] & mask[:, None, :]
    return in_exact, visible[None] & mask[:, None, :] & ~in_exact


def reference(q, k, v, w, sinks, window, causal, mask):
    """Every weight written out: exp(q.k) on the exact set, phi(q).phi(k) elsewhere, one normaliser."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    dim, m = q.shape[-1], w.shape[0]
    qs, ks = q * dim**-0.25, k * dim**-0.25
    exact = torch.exp(qs @ ks.transpose(-1, -2))
    phi = lambda x: torch.exp(x @ w.T - (x**2).sum(-1, keepdim=True) / 2) / math.sqrt(m)  # noqa: E731
    favor = phi(qs) @ phi(ks).transpose(-1, -2)
    in_exact, in_favor = key_sets(mask, sinks, window, causal)
    weights = torch.where(in_exact[:, None], exact, 0) + torch.where(in_favor[:, None], favor, 0)
    return (weights @ v) / weights.sum(-1, keepdim=True)


def run(causal, q, k, v, w, **kw):
    if causal:
        return causal_local_attention(q, k, v, projection=w, chunk_size=8, **kw)[0]
    return local_attention(q, k, v, projection=w, chunk_size=8, **kw)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("sinks, window", [(0, 1), (2, 5), (3, 0), (0, 7), (4, 40), (1, 9)])
def test_matches_the_quadratic_reference_with_padding(causal, sinks, window):
    q, k, v = qkv()
    w = projection()
    mask = torch.ones(2, 37, dtype=torch.bool)
    if causal:
        mask[1, :6] = False  # left padding: the sinks of row 1 are its first real tokens
    else:
        mask[1, -6:] = False
    out = run(causal, q, k, v, w, sink_tokens=sinks, local_window=window, key_padding_mask=mask)
    ref = reference(q, k, v, w, sinks, window, causal, mask)
    real = mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_is_exact_softmax_when_sinks_and_window_cover_the_sequence(causal):
    q, k, v = qkv(length=20)
    out = run(causal, q, k, v, projection(), sink_tokens=2, local_window=20 if causal else 20)
    rep = q.shape[1] // k.shape[1]
    exact = sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)


def test_prefill_then_steps_equal_one_call_and_the_state_stays_the_same_size():
    q, k, v = qkv(length=40)
    w = projection()
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False
    settings = dict(projection=w, sink_tokens=2, local_window=5, chunk_size=4)
    whole, _ = causal_local_attention(q, k, v, key_padding_mask=mask, **settings)
    out, state = causal_local_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], key_padding_mask=mask[:, :11],
                                        **settings)
    outs, sizes = [out], set()
    for t in range(11, 40):
        step = slice(t, t + 1)
        out, state = causal_local_attention(q[:, :, step], k[:, :, step], v[:, :, step], state=state,
                                            key_padding_mask=mask[:, step], **settings)
        outs.append(out)
        sizes.add(state.nbytes())
    torch.testing.assert_close(torch.cat(outs, 2), whole, rtol=1e-12, atol=1e-12)
    assert len(sizes) == 1 and state.position == 40


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_low_precision_with_large_norms_stays_finite(causal):
    q, k, v = qkv(batch=1, length=300, dim=64, norm=3.0, dtype=torch.float32)  # scaled norms ~ 3 sqrt(8)
    w = draw_projection(64, 64, generator=torch.Generator().manual_seed(0))
    out = run(causal, q.bfloat16(), k.bfloat16(), v.bfloat16(), w, sink_tokens=4, local_window=16)
    ref = run(causal, q.double(), k.double(), v.double(), w.double(), sink_tokens=4, local_window=16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.05


def test_per_head_projections_and_gradients():
    q, k, v = qkv(batch=1, length=12, norm=1.0)
    w = torch.stack([projection(seed=s) for s in range(4)]).requires_grad_(True)  # (H, m, D)
    ref = reference(q, k, v, w[1].detach(), 1, 3, True, torch.ones(1, 12, dtype=torch.bool))[:, 1]
    out = run(True, q, k, v, w, sink_tokens=1, local_window=3)
    torch.testing.assert_close(out[:, 1], ref, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(lambda p: run(True, q, k, v, p, sink_tokens=1, local_window=3), (w,))
    assert torch.autograd.gradcheck(lambda p: run(False, q, k, v, p, sink_tokens=1, local_window=3), (w,))


def test_kernels_that_do_not_estimate_softmax_are_refused():
    q, k, v = qkv(length=8)
    for kernel in ("relu", "trig"):
        for causal in (True, False):
            with pytest.raises(ValueError, match=f"'{kernel}' cannot"):
                run(causal, q, k, v, projection(), kernel=kernel, sink_tokens=1, local_window=2)


def anchored_reference(q, k, v, w, sinks, window, causal, mask, bias, feature_bias):
    """Hedgehog beside exact weights, written out: exp(q.k) on the exact set; elsewhere exp(a_i + b_h) phi(q).phi(k)
    with phi = softmax([Wx + c, -(Wx + c)]) (c the query or the key feature bias) and a_i the row's largest exact
    logit."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    dim = q.shape[-1]
    qs, ks = q * dim**-0.25, k * dim**-0.25
    logits = qs @ ks.transpose(-1, -2)
    phi = lambda x, c: torch.cat([x @ w.T + c, -(x @ w.T + c)], -1).softmax(-1)  # noqa: E731
    favor = phi(qs, feature_bias[0]) @ phi(ks, feature_bias[1]).transpose(-1, -2)
    in_exact, in_favor = key_sets(mask, sinks, window, causal)
    anchor = logits.masked_fill(~in_exact[:, None], float("-inf")).amax(-1, keepdim=True)
    far = favor * (anchor + bias[:, None, None]).exp()
    weights = torch.where(in_exact[:, None], logits.exp(), 0) + torch.where(in_favor[:, None], far, 0)
    return (weights @ v) / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("sinks, window", [(0, 1), (2, 5), (3, 0), (4, 9)])
def test_hedgehog_terms_are_anchored_to_the_rows_largest_exact_logit(causal, sinks, window):
    q, k, v = qkv(norm=2.0)
    w = projection()
    bias = torch.tensor([0.3, -0.5, 1.0, 0.0], dtype=torch.float64)  # per head
    feature_bias = torch.randn(2, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :6] = False
    out = run(causal, q, k, v, w, kernel="hedgehog", sink_tokens=sinks, local_window=window, key_padding_mask=mask,
              favor_bias=bias, feature_bias=feature_bias)
    ref = anchored_reference(q, k, v, w, sinks, window, causal, mask, bias, feature_bias)
    real = mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-10, atol=1e-10)
    # the far context matters: dropping it changes the outputs
    alone = run(causal, q, k, v, w, kernel="hedgehog", sink_tokens=sinks, local_window=window,
                key_padding_mask=mask, favor=False)
    assert (out - alone)[real].abs().max() > 1e-2


def test_hedgehog_with_a_window_steps_equal_one_call_and_has_exact_gradients():
    q, k, v = qkv(length=30)
    w = projection()
    settings = dict(projection=w, kernel="hedgehog", sink_tokens=2, local_window=5, chunk_size=4,
                    feature_bias=torch.randn(2, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    whole, state = causal_local_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], **settings)
    outs = [whole]
    for t in range(9, 30):
        out, state = causal_local_attention(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state=state,
                                            **settings)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), causal_local_attention(q, k, v, **settings)[0],
                               rtol=1e-12, atol=1e-12)
    q, k, v = qkv(batch=1, length=12, norm=1.0)
    w = torch.stack([projection(seed=s) for s in range(4)]).requires_grad_(True)
    bias = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    feature_bias = (0.5 * torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
                    ).requires_grad_()  # per head, as w
    for causal in (True, False):
        assert torch.autograd.gradcheck(
            lambda p, b, f, c=causal: run(c, q, k, v, p, kernel="hedgehog", sink_tokens=1, local_window=3,
                                          favor_bias=b, feature_bias=f),
            (w, bias, feature_bias))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_without_favor_only_sinks_and_window_count(causal):
    q, k, v = qkv(batch=1, length=30)
    out = run(causal, q, k, v, projection(), sink_tokens=2, local_window=4, favor=False)
    rep = q.shape[1] // k.shape[1]
    i, j = torch.arange(30)[:, None], torch.arange(30)[None]
    band = ((j <= i) & (j > i - 4)) if causal else (i - j).abs() < 4
    allowed = band | ((j < 2) & ((j <= i) if causal else True))
    exact = sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=allowed)
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("local", [(0, 0), (2, 3)], ids=["pure", "local"])
@pytest.mark.parametrize("kernel", ["favor+", "hyperbolic"])
def test_grouped_heads_keep_their_favor_sums_per_key_value_head(local, kernel):
    """The 3 query heads of each key/value head share its key features: the state holds 2 heads' sums, not 6, and
    outputs equal those of the same keys repeated per query head (float64)."""
    from performer_hf.favor import causal_favor_attention, favor_attention

    torch.manual_seed(0)
    q = torch.randn(2, 6, 20, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 20, 8, dtype=torch.float64), torch.randn(2, 2, 20, 8, dtype=torch.float64)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :5] = False
    w = draw_projection(16, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sinks, window = local
    common = dict(projection=w, kernel=kernel, key_padding_mask=mask, chunk_size=4)
    rk, rv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    if window:
        extra = dict(sink_tokens=sinks, local_window=window)
        grouped, state = causal_local_attention(q, k, v, **common, **extra)
        repeated, _ = causal_local_attention(q, rk, rv, **common, **extra)
        both = [local_attention(q, x, y, **common, **extra) for x, y in ((k, v), (rk, rv))]
        kv = state.favor.kv
    else:
        grouped, state = causal_favor_attention(q, k, v, **common)
        repeated, _ = causal_favor_attention(q, rk, rv, **common)
        both = [favor_attention(q, x, y, **common) for x, y in ((k, v), (rk, rv))]
        kv = state.kv
    torch.testing.assert_close(grouped, repeated, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(both[0], both[1], rtol=1e-10, atol=1e-12)
    assert kv.shape[1] == 2
