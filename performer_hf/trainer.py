"""Redraws for transformers' `Trainer`: `performer-hf finetune` redraws projections every `redraw_interval` steps
itself; a `Trainer` knows nothing of them, so add `RedrawCallback()` to its callbacks.

Example:
    >>> trainer = Trainer(model=converted, args=args, train_dataset=data,
    ...                   callbacks=[performer_hf.RedrawCallback()])  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from .conversion import mark_redraws_applied, performer_settings, redraw_projections


class RedrawCallback(TrainerCallback):
    """Draw fresh projections every `interval` optimizer steps (default: the model's saved `redraw_interval`).

    Each redraw uses a generator seeded from `seed` and the step, the same on every process, so data-parallel replicas
    stay identical and a resumed run redraws as the uninterrupted one would. Learned projections are never redrawn.
    """

    def __init__(self, interval: int | None = None, seed: int = 42):
        if interval is not None and interval < 0:
            raise ValueError(f"RedrawCallback interval must be 0 (never) or positive, got {interval}")
        self.interval, self.seed = interval, seed

    def _interval(self, model) -> int:
        if self.interval is not None:
            return self.interval
        settings = performer_settings(model.config)
        if settings is None:
            raise ValueError("RedrawCallback needs a model converted by performer_hf (performer_hf.convert or "
                             "performer_hf.from_pretrained)")
        return settings.redraw_interval or 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._interval(model)  # fail early on an unconverted model
        mark_redraws_applied(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        interval = self._interval(model)
        if interval and state.global_step % interval == 0:
            redraw_projections(model, torch.Generator().manual_seed(self.seed * 1_000_003 + state.global_step))
