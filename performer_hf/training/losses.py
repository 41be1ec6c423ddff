"""Losses of the fine-tune: the task loss and distillation towards the original softmax model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fidelity import mean_pooled


def logit_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0):
    """Mean over real tokens of KL(teacher || student) on temperature-softened distributions, times T^2."""
    log_q = F.log_softmax(student.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher.float() / temperature, dim=-1)
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, L)
    weights = mask.to(per_token.dtype)
    return (per_token * weights).sum() / weights.sum().clamp_min(1) * temperature**2


def hidden_mse(student_states, teacher_states, mask: torch.Tensor, layers: str = "all"):
    """Mean over the chosen layers of the MSE between hidden states of real tokens, each layer normalised by the
    teacher's mean squared activation (so layers of different scales weigh alike)."""
    pairs = list(zip(student_states, teacher_states, strict=True))
    if layers == "last":
        pairs = pairs[-1:]
    else:
        pairs = pairs[1:]  # the embeddings are the same tensors in both models
    weights = mask.to(torch.float32).unsqueeze(-1)
    total = 0.0
    for s, t in pairs:
        s, t = s.float(), t.float()
        err = ((s - t) ** 2 * weights).sum() / (weights.sum() * s.shape[-1]).clamp_min(1)
        scale = (t**2 * weights).sum() / (weights.sum() * t.shape[-1]).clamp_min(1)
        total = total + err / scale.clamp_min(1e-6)
    return total / len(pairs)


def embedding_cosine_loss(student_last: torch.Tensor, teacher_last: torch.Tensor, mask: torch.Tensor):
    """Mean over the batch of 1 - cosine between the sentence embeddings (`fidelity.mean_pooled`, the pooling of
    sentence-transformers models) of the last hidden states."""
    student, teacher = (mean_pooled(h.float(), mask) for h in (student_last, teacher_last))
    return (1 - (student * teacher).sum(-1)).mean()
