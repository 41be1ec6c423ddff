"""Random feature maps phi with phi(x) . phi(y) ~ exp(x . y) (or, for ReLU, a kernel of its own).

Inputs `x` are queries or keys already multiplied by sqrt(scale), so exp(x . y) is the unnormalised softmax weight.
Every map returns a pair `(base, log_scale)` with

    phi(x) = base * exp(log_scale)[..., None]          # base (..., L, m'), log_scale (..., L)

where `base` is bounded (at most 1 for the exponential maps). Keeping the per-token scale apart is what makes the
attention numerically safe: per query row it cancels exactly, and for keys it is subtracted by its maximum before it is
ever exponentiated. `materialize` puts the two back together for inspection.
"""

from __future__ import annotations

import math

import torch

KERNELS = ("favor+", "hyperbolic", "favor++", "hedgehog", "trig", "relu")
POSITIVE_KERNELS = ("favor+", "hyperbolic", "favor++", "hedgehog", "relu")
LEARNED_ONLY_KERNELS = ("hedgehog",)  # no estimator of softmax until trained


def materialize(base: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """phi(x) from a `(base, log_scale)` pair. Overflows for large norms: for tests and inspection only."""
    return base * log_scale.exp().unsqueeze(-1)


def _split_log_features(log_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(u) as (exp(u - max_f u), max_f u): the max over features of each row."""
    log_scale = log_features.amax(dim=-1)
    return (log_features - log_scale.unsqueeze(-1)).exp(), log_scale


def _half_sq_norm(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x.pow(2).sum(dim=-1)  # (..., L)


EXP_KERNELS = ("favor+", "hyperbolic", "favor++", "hedgehog")
# the maps that can run beside exact softmax weights (sinks, local window) are the exponential ones: favor+, hyperbolic
# and favor++ estimate exp(q.k) itself, scale included; hedgehog's features are normalised per token, so its terms are
# anchored to each query's largest exact logit (ANCHORED_KERNELS, see favor.local)
WINDOW_KERNELS = EXP_KERNELS
ANCHORED_KERNELS = ("hedgehog",)


def exp_logits(
    x: torch.Tensor, projection: torch.Tensor, kernel: str, a: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential feature maps as phi(x) = exp(u - offset[..., None]) / sqrt(m'), returned as `(u, offset)`.

    `u` (..., L, m') carries everything that varies across features and `offset` (..., L) the per-token terms, so
    the attention kernel can subtract stabilisers and exponentiate in place, in one pass. The 1/sqrt(m') is left out:
    a constant cancels in attention. `bias` (hedgehog only), `(m,)` or per head `(H, m)`, is added to W x.
    """
    if bias is not None and kernel != "hedgehog":
        raise ValueError(f"a feature bias belongs to the learned hedgehog map, not to {kernel!r}")
    if kernel == "favor+":
        return x @ projection.mT, _half_sq_norm(x)  # (..., L, m), (..., L)
    if kernel == "hyperbolic":
        wx = x @ projection.mT
        return torch.cat([wx, -wx], dim=-1), _half_sq_norm(x)  # (..., L, 2m)
    if kernel == "hedgehog":
        # softmax over [w.x, -w.x]: each token's features sum to one (the per-token normaliser is the offset). The
        # log-sum-exp is taken from wx, not from the concatenation, which the kernel later shifts in place.
        wx = _hedgehog_projection(x, projection, bias)
        return torch.cat([wx, -wx], dim=-1), torch.logaddexp(wx.logsumexp(-1), (-wx).logsumexp(-1))
    if kernel == "favor++":
        if a is None:
            raise ValueError("the favor++ feature map needs `a` (see favor_plus_plus_a)")
        d = projection.shape[-1]
        a = torch.as_tensor(a, dtype=x.dtype, device=x.device)
        one_minus_4a = 1 - 4 * a  # (...) per batch element and head, or a scalar
        # B w.x + A |w|^2 as one matmul: x gets a column of ones, the projection a column A |w|^2
        w_sq = projection.pow(2).sum(-1)  # (m,)
        scaled = torch.sqrt(one_minus_4a)[..., None, None] * projection  # (..., m, d)
        bias = a[..., None] * w_sq  # (..., m)
        augmented = torch.cat([scaled, bias.unsqueeze(-1).expand(scaled.shape[:-1] + (1,))], dim=-1)  # (..., m, d+1)
        x1 = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)  # (..., L, d+1)
        log_d = 0.25 * d * torch.log(one_minus_4a)
        return x1 @ augmented.transpose(-1, -2), _half_sq_norm(x) - log_d[..., None]
    raise ValueError(f"{kernel!r} is not an exponential feature map; those are {EXP_KERNELS}")


def _hedgehog_projection(x, projection, bias=None):
    wx = x @ projection.mT
    if bias is not None:
        wx = wx + (bias.unsqueeze(-2) if bias.dim() == 2 else bias)  # (H, 1, m) against (..., H, L, m)
    return wx


def hedgehog_logits(x: torch.Tensor, projection: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[W x + b, -(W x + b)] (..., L, 2m): the hedgehog map is the softmax of these over the last dimension. Without
    `exp_logits`' per-token normaliser, for callers that normalise with one fused softmax instead."""
    wx = _hedgehog_projection(x, projection, bias)
    return torch.cat([wx, -wx], dim=-1)


def _exp_features(x, projection, kernel, a=None, bias=None):
    u, offset = exp_logits(x, projection, kernel, a, bias)
    base, row_max = _split_log_features(u)
    return base, row_max - offset - 0.5 * math.log(u.shape[-1])


def positive_features(x: torch.Tensor, projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FAVOR+ positive features: phi(x) = exp(w . x - |x|^2 / 2) / sqrt(m). Unbiased for exp(x . y), always > 0."""
    return _exp_features(x, projection, "favor+")


def hyperbolic_features(x: torch.Tensor, projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hyperbolic positive features: [exp(w.x), exp(-w.x)] * exp(-|x|^2 / 2) / sqrt(2m). Lower variance, 2m columns."""
    return _exp_features(x, projection, "hyperbolic")


def hedgehog_features(
    x: torch.Tensor, projection: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learned feature map in the manner of Hedgehog (Zhang et al., 2024): phi(x) = softmax([W x + b, -(W x + b)]),
    2m columns summing to one. Not an estimator of exp(x . y) for a random W: `W` (per head) and the optional bias
    `b` must be trained, by attention transfer, to make phi(q) . phi(k) proportional to the softmax weights."""
    return _exp_features(x, projection, "hedgehog", bias=bias)


def favor_plus_plus_a(q: torch.Tensor, k: torch.Tensor, q_mask=None, k_mask=None) -> torch.Tensor:
    """The variance-optimal A of FAVOR++ (Likhosherstov et al., 2022) for the (scaled) queries and keys given.

    A = (1 - 2 rho - sqrt((2 rho + 1)^2 + 8 rho)) / 16 with rho = mean over query/key pairs of |q + k|^2 / d, computed
    from means and mean squared norms in O(L d). Masks (`(..., L)`, True = real token) keep padding out of the
    statistics. Returns A with shape `q.shape[:-2]` (one value per batch element and head); always negative.
    """

    def moments(x, mask):
        if mask is None:
            return x.pow(2).sum(-1).mean(-1), x.mean(-2)
        w = mask.to(x.dtype)
        count = w.sum(-1).clamp_min(1.0)
        return (x.pow(2).sum(-1) * w).sum(-1) / count, (x * w.unsqueeze(-1)).sum(-2) / count.unsqueeze(-1)

    q_sq, q_mean = moments(q, q_mask)
    k_sq, k_mean = moments(k, k_mask)
    return favor_plus_plus_a_from_moments(q_sq, q_mean, k_sq, k_mean)


def favor_plus_plus_a_from_moments(q_sq, q_mean, k_sq, k_mean) -> torch.Tensor:
    """FAVOR++'s A from the mean squared norms (...,) and mean vectors (..., d) of scaled queries and keys."""
    rho = (q_sq + k_sq + 2 * (q_mean * k_mean).sum(-1)) / q_mean.shape[-1]
    return (1 - 2 * rho - torch.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16


def favor_plus_plus_features(
    x: torch.Tensor, projection: torch.Tensor, a: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FAVOR++ optimal positive features: f(w, x) = D exp(A |w|^2 + B w.x - |x|^2 / 2) / sqrt(m).

    B = sqrt(1 - 4A), D = (1 - 4A)^(d/4), A < 1/8; A = 0 is FAVOR+. Unbiased for exp(x . y) for any such A when the
    rows of `projection` are marginally N(0, I_d). `a` is a float or a tensor broadcastable to `x.shape[:-2]`.
    """
    return _exp_features(x, projection, "favor++", a)


def trig_features(x: torch.Tensor, projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Trigonometric random Fourier features: exp(|x|^2 / 2) [sin(w.x), cos(w.x)] / sqrt(m).

    Unbiased but not positive: the attention normaliser can reach zero or go negative. For comparison only.
    """
    m = projection.shape[-2]
    wx = x @ projection.mT
    base = torch.cat([torch.sin(wx), torch.cos(wx)], dim=-1) / math.sqrt(m)  # (..., L, 2m)
    return base, _half_sq_norm(x)


def relu_features(x: torch.Tensor, projection: torch.Tensor, eps: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's generalized attention (Performer-ReLU): phi(x) = (relu(w . x) + eps) / sqrt(m).

    Not an approximation of softmax: its own kernel, positive by construction.
    """
    m = projection.shape[-2]
    base = (torch.relu(x @ projection.mT) + eps) / math.sqrt(m)
    return base, torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)


def feature_map(
    x: torch.Tensor, projection: torch.Tensor, kernel: str, a: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the feature map of `kernel` (one of `KERNELS`); `a` is FAVOR++'s A."""
    if kernel == "favor+":
        return positive_features(x, projection)
    if kernel == "hyperbolic":
        return hyperbolic_features(x, projection)
    if kernel == "hedgehog":
        return hedgehog_features(x, projection)
    if kernel == "favor++":
        if a is None:
            raise ValueError("the favor++ feature map needs `a` (see favor_plus_plus_a)")
        return favor_plus_plus_features(x, projection, a)
    if kernel == "trig":
        return trig_features(x, projection)
    if kernel == "relu":
        return relu_features(x, projection)
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
