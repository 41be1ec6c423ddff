"""How far a converted model is from its original: measured on the same tokens, before and after conversion."""

from __future__ import annotations

from importlib import resources

import torch
import torch.nn.functional as F


def builtin_sentences() -> list[str]:
    """Forty held-out English sentences shipped with the package (never used for training)."""
    text = resources.files("performer_hf").joinpath("data/sentences.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def calibration_batch(tokenizer, count: int = 32, max_length: int = 128):
    """Model inputs for FAVOR++ calibration: the first `count` training paragraphs of the built-in corpus (never
    the held-out sentences of the fidelity report)."""
    from .training.data import builtin_corpus

    return encode(tokenizer, builtin_corpus()[:count], max_length=max_length)


def encode(tokenizer, texts: list[str], max_length: int = 128):
    return tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")


@torch.no_grad()
def outputs(model, batch) -> torch.Tensor:
    """Logits for models with an LM head, last hidden states otherwise (float32)."""
    model_inputs = {k: v.to(model.device) for k, v in batch.items() if k in ("input_ids", "attention_mask",
                                                                          "token_type_ids")}
    out = model(**model_inputs)
    tensor = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    return tensor.float().cpu()


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Unit-norm sentence embeddings: the mean of the real tokens' hidden states (sentence-transformers' pooling)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp_min(1), dim=-1)


def compare(reference: torch.Tensor, converted: torch.Tensor, attention_mask: torch.Tensor, is_lm: bool) -> dict:
    """Fidelity figures over the real tokens.

    LM heads: `kl` (mean token-level KL(original || converted), nats) and `top1` (agreement of the arg-max
    predictions). Base models: `token_cosine` (mean cosine of hidden states) and `embedding_cosine` (mean cosine of
    mean-pooled sentence embeddings).
    """
    real = attention_mask.bool()
    if is_lm:
        log_p, log_q = reference.log_softmax(-1), converted.log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)[real]
        top1 = (reference.argmax(-1) == converted.argmax(-1))[real].float()
        return {"kl": max(kl.mean().item(), 0.0), "top1": top1.mean().item()}  # KL >= 0; float noise aside
    token_cos = F.cosine_similarity(reference, converted, dim=-1)[real]
    emb_cos = (mean_pooled(reference, attention_mask) * mean_pooled(converted, attention_mask)).sum(-1)
    return {"token_cosine": token_cos.mean().item(), "embedding_cosine": emb_cos.mean().item()}


def format_report(metrics: dict, title: str = "fidelity to the original softmax model") -> str:
    """A small two-column markdown table."""
    names = {"kl": "token KL(original || converted), nats (0 = identical)",
             "top1": "top-1 prediction agreement (1 = identical)",
             "token_cosine": "hidden-state cosine, per token (1 = identical)",
             "embedding_cosine": "sentence-embedding cosine (1 = identical)"}
    lines = [f"| {title} | value |", "|---|---|"]
    lines += [f"| {names.get(k, k)} | {v:.4f} |" for k, v in metrics.items()]
    return "\n".join(lines)
