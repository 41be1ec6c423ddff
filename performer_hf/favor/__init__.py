"""FAVOR+ math: pure tensor functions, no Hugging Face imports."""

from .features import (
    EXP_KERNELS,
    KERNELS,
    LEARNED_ONLY_KERNELS,
    POSITIVE_KERNELS,
    WINDOW_KERNELS,
    exp_logits,
    favor_plus_plus_a,
    favor_plus_plus_a_from_moments,
    favor_plus_plus_features,
    feature_map,
    hedgehog_features,
    hyperbolic_features,
    materialize,
    positive_features,
    relu_features,
    trig_features,
)
from .kernel import FavorState, causal_favor_attention, favor_attention, favor_step
from .local import LocalState, causal_local_attention, local_attention
from .projections import NORM_KINDS, PROJECTION_KINDS, draw_projection, hadamard_matrix

__all__ = [
    "EXP_KERNELS", "exp_logits", "KERNELS", "POSITIVE_KERNELS", "NORM_KINDS", "PROJECTION_KINDS", "FavorState",
    "LocalState", "causal_favor_attention", "causal_local_attention", "local_attention", "draw_projection",
    "favor_attention", "favor_plus_plus_a", "favor_plus_plus_a_from_moments", "favor_plus_plus_features",
    "favor_step", "feature_map", "hadamard_matrix", "hedgehog_features", "hyperbolic_features",
    "LEARNED_ONLY_KERNELS", "WINDOW_KERNELS", "materialize", "positive_features",
    "relu_features", "trig_features",
]
