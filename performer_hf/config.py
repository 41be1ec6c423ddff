"""Settings of a Performer conversion, saved into the model's config.json under the key "performer"."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from .favor import KERNELS, NORM_KINDS, PROJECTION_KINDS

CONFIG_KEY = "performer"
FORMAT_VERSION = 1


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
                                                            "approximate softmax; trig is for comparison only; relu "
                                                            "is the paper's generalized attention."})
    projection: str = field(default="orthogonal", metadata={"help": f"Random projection, one of {PROJECTION_KINDS}."})
    norms: str = field(default="chi", metadata={"help": f"Row norms of the projection, one of {NORM_KINDS}: chi keeps "
                                                        "the estimator unbiased, fixed gives every row sqrt(d)."})
    redraw_interval: int | None = field(default=None, metadata={"help": "Redraw projections every N training steps "
                                                                        "(None: never). Forward never redraws."})
    chunk_size: int = field(default=64, metadata={"help": "Tokens per block of the causal computation."})
    seed: int = field(default=0, metadata={"help": "Seed of the initial projections."})

    def __post_init__(self):
        def positive_int(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PerformerConfig.{name} must be a positive integer, got {value!r}")

        positive_int("num_features", self.num_features)
        positive_int("chunk_size", self.chunk_size)
        if self.redraw_interval is not None:
            positive_int("redraw_interval", self.redraw_interval)
        for name, allowed in (("kernel", KERNELS), ("projection", PROJECTION_KINDS), ("norms", NORM_KINDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"PerformerConfig.{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"PerformerConfig.seed must be an integer, got {self.seed!r}")

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
