"""Settings of a Performer conversion, saved into the model's config.json under the key "performer"."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from .favor import KERNELS, LEARNED_ONLY_KERNELS, NORM_KINDS, PROJECTION_KINDS, WINDOW_KERNELS

CONFIG_KEY = "performer"
FORMAT_VERSION = 2  # 2: sinks, local window, learned features, stored FAVOR++ A

# What `None` means for sink_tokens / local_window: causal LMs keep exact attention to their attention sinks and a
# recent window (zero-shot SmolLM2 on 8 held-out 512-token windows: 1.10x the original perplexity with a window of
# 128, 1.26x with 64, 51x with pure FAVOR); bidirectional encoders of short sentences would be nearly exact with
# any band, so they stay pure FAVOR.
CAUSAL_DEFAULTS = {"sink_tokens": 4, "local_window": 128}
BIDIRECTIONAL_DEFAULTS = {"sink_tokens": 0, "local_window": 0}
MAX_NUM_FEATURES = 1 << 16


@dataclass
class PerformerConfig:
    """How to convert softmax attention to FAVOR attention.

    Every field is validated on construction; a bad value raises a `ValueError` naming the field and what it accepts.
    Unknown keys met when loading a saved config (from a newer version) warn and are dropped.

    Example:
        >>> PerformerConfig(num_features=128, kernel="favor++").kernel
        'favor++'
    """

    num_features: int = field(default=256, metadata={"help": "Random features m per attention layer (paper: 256 for "
                                                             "head dim 64; more features, lower error)."})
    kernel: str = field(default="favor+", metadata={"help": f"Feature map, one of {KERNELS}. favor+ and favor++ "
                                                            "approximate softmax; hedgehog is a learned softmax "
                                                            "feature map (needs learned_features and training); "
                                                            "trig is for comparison only; relu is the paper's "
                                                            "generalized attention."})
    projection: str = field(default="orthogonal", metadata={"help": f"Random projection, one of {PROJECTION_KINDS}."})
    norms: str = field(default="chi", metadata={"help": f"Row norms of the projection, one of {NORM_KINDS}: chi keeps "
                                                        "the estimator unbiased, fixed gives every row sqrt(d)."})
    redraw_interval: int | None = field(default=None, metadata={"help": "Redraw projections every N training steps "
                                                                        "(None: never). Forward never redraws."})
    chunk_size: int = field(default=64, metadata={"help": "Tokens per block of the causal computation."})
    seed: int = field(default=0, metadata={"help": "Seed of the initial projections."})
    sink_tokens: int | None = field(default=None, metadata={"help": "Exact softmax weights for the first S real "
                                                                     "tokens (attention sinks). None: 4 for causal "
                                                                     "models, 0 for bidirectional ones."})
    local_window: int | None = field(default=None, metadata={"help": "Exact softmax weights for the W most recent "
                                                                     "keys (causal) or keys within W positions "
                                                                     "(bidirectional); FAVOR for the rest. None: 128 "
                                                                     "for causal models, 0 for bidirectional ones."})
    favor_beyond_window: bool = field(default=True, metadata={"help": "FAVOR for the keys beyond the sinks and "
                                                                      "the window; False drops them (StreamingLLM's "
                                                                      "attention, kept for comparison)."})
    learned_features: bool = field(default=False, metadata={"help": "Make the projection a trainable parameter "
                                                                    "(initialised from the random draw, saved with "
                                                                    "the model, never redrawn); train it with "
                                                                    "attention transfer."})
    per_head_features: bool = field(default=False, metadata={"help": "One projection per attention head instead of "
                                                                     "one per layer (more parameters to learn)."})
    feature_bias: bool = field(default=False, metadata={"help": "hedgehog only: learned per-feature biases for "
                                                                "queries and keys, phi(x) = softmax([Wx + b, "
                                                                "-(Wx + b)]), initialised to zero."})

    def __post_init__(self):
        def positive_int(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PerformerConfig.{name} must be a positive integer, got {value!r}")

        positive_int("num_features", self.num_features)
        positive_int("chunk_size", self.chunk_size)
        if self.num_features > MAX_NUM_FEATURES:
            raise ValueError(f"PerformerConfig.num_features must be at most {MAX_NUM_FEATURES}, got "
                             f"{self.num_features}; error stops falling long before that (the paper uses 256)")
        if self.redraw_interval is not None:
            positive_int("redraw_interval", self.redraw_interval)
        for name in ("sink_tokens", "local_window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"PerformerConfig.{name} must be a non-negative integer or None, got {value!r}")
        for name in ("learned_features", "per_head_features", "favor_beyond_window", "feature_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PerformerConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name, allowed in (("kernel", KERNELS), ("projection", PROJECTION_KINDS), ("norms", NORM_KINDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"PerformerConfig.{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"PerformerConfig.seed must be an integer, got {self.seed!r}")
        if (self.sink_tokens or self.local_window) and self.kernel not in WINDOW_KERNELS:
            raise ValueError(f"PerformerConfig: sink_tokens and local_window need a kernel that can share a "
                             f"normaliser with exact softmax weights ({', '.join(WINDOW_KERNELS)}), got "
                             f"kernel={self.kernel!r}; set sink_tokens=0 and local_window=0")
        if self.kernel in LEARNED_ONLY_KERNELS and not self.learned_features:
            raise ValueError(f"PerformerConfig: kernel={self.kernel!r} is a learned feature map (no estimate of "
                             "softmax until trained); set learned_features=True (--learned-features) and train it with "
                             "attention transfer")
        if self.feature_bias and self.kernel != "hedgehog":
            raise ValueError(f"PerformerConfig: feature_bias belongs to the learned hedgehog map, not to kernel="
                             f"{self.kernel!r}; use kernel='hedgehog' or drop feature_bias")
        if self.learned_features and self.redraw_interval is not None:
            raise ValueError("PerformerConfig: learned features are trained, never redrawn; drop redraw_interval")

    def resolved(self, causal: bool) -> PerformerConfig:
        """These settings with `None` sink_tokens / local_window replaced by the defaults for causal or
        bidirectional models (a causal model with a relu or trig kernel gets none)."""
        defaults = CAUSAL_DEFAULTS if causal and self.kernel in WINDOW_KERNELS else BIDIRECTIONAL_DEFAULTS
        return dataclasses.replace(self, **{k: v if getattr(self, k) is None else getattr(self, k)
                                            for k, v in defaults.items()})

    @property
    def is_local(self) -> bool:
        return bool(self.sink_tokens or self.local_window)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PerformerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(f"ignoring unknown Performer settings {unknown} (saved by a newer performer_hf?)",
                          stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})

    def replace(self, **overrides) -> PerformerConfig:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown PerformerConfig fields {unknown}; "
                             f"fields are {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **overrides)
