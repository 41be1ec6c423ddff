"""The attention-transfer stage (as in LoLCATs' first stage): every converted layer learns to reproduce its own
softmax attention output on the same inputs.

One forward pass runs the model with exact attention (so each layer sees the original model's hidden states: teacher
forcing, no second model in memory); inside it each layer also computes its FAVOR output from the same q, k, v and
records the relative squared error to the exact output. Only the feature maps (learned projections) train, so all
layers learn at once from one pass, and the target cannot drift: q, k and v are the original model's.
"""

from __future__ import annotations

import contextlib

import torch

from ..conversion import converted_modules
from .context import Stage


@contextlib.contextmanager
def attention_transfer(model):
    """Within the block, a forward pass of `model` runs exact attention and leaves each converted layer's error in
    its `transfer_loss` (yielded: the FAVOR modules in order). The modes are restored on exit."""
    favors = list(converted_modules(model).values())
    for favor in favors:
        favor.mode, favor.transfer_loss = "transfer", None
    try:
        yield favors
    finally:
        for favor in favors:
            favor.mode, favor.transfer_loss = "favor", None


@torch.no_grad()
def layer_errors(model, inputs: dict) -> list[float]:
    """Each converted layer's relative squared error ||favor - exact||^2 / ||exact||^2 on `inputs`, in order."""
    with attention_transfer(model) as favors:
        model(**inputs)
        return [float(f.transfer_loss) for f in favors]


def train_only_feature_maps(model) -> int:
    """Freeze everything but the FAVOR modules' parameters; returns how many tensors stay trainable."""
    trainable = [p for favor in converted_modules(model).values() for p in favor.parameters()]
    if not trainable:
        raise ValueError("attention transfer trains the feature maps, and this model has none to train: convert with "
                         "learned_features=True (performer-hf convert --learned-features)")
    model.requires_grad_(False)
    for param in trainable:
        param.requires_grad_(True)
    return len(trainable)


class AttentionTransfer(Stage):
    description = "attention transfer"
    mlm_inputs = False

    def _run(self, batch):
        """One teacher-forced pass; the mean over layers of each layer's relative error. A single process calls
        the base model directly (no output head: nothing downstream of the last layer matters here)."""
        model = self.accelerator.unwrap_model(self.model)
        runner = model.base_model if self.accelerator.num_processes == 1 else self.model
        with attention_transfer(model) as favors:
            runner(**self._inputs(batch))
            return torch.stack([f.transfer_loss for f in favors])  # (layers,)

    def loss(self, batch):
        errors = self._run(batch)
        loss = errors.mean()
        return loss, {"attention_loss": loss.detach().item()}

    @torch.no_grad()
    def evaluate(self, eval_dl, step) -> dict:
        self.model.eval()
        per_layer = []
        for batch in eval_dl:
            per_layer.append(self.accelerator.gather_for_metrics(self._run(batch).float().unsqueeze(0)))
        self.model.train()
        errors = torch.cat(per_layer).mean(0)
        return {"step": step, "eval_loss": errors.mean().item(), "eval_attention_error": errors.mean().item(),
                "eval_attention_error_per_layer": [round(e, 5) for e in errors.tolist()]}
