"""How far a converted model is from its original: measured on the same tokens, before and after conversion."""

from __future__ import annotations

import contextlib
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
    from .corpus import builtin_corpus

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


def format_report(columns: dict, title: str = "fidelity to the original softmax model") -> str:
    """A small markdown table: one row per metric, one column per `{column name: metrics}` (or one metrics dict)."""
    if not all(isinstance(v, dict) for v in columns.values()):
        columns = {"value": columns}
    names = {"kl": "token KL(original || converted), nats (0 = identical)",
             "top1": "top-1 prediction agreement (1 = identical)",
             "token_cosine": "hidden-state cosine, per token (1 = identical)",
             "embedding_cosine": "sentence-embedding cosine (1 = identical)"}
    lines = [f"| {title} | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
    for key in next(iter(columns.values())):
        lines.append(f"| {names.get(key, key)} | {' | '.join(f'{c[key]:.4f}' for c in columns.values())} |")
    return "\n".join(lines)


@contextlib.contextmanager
def pure_favor(model):
    """Within the block, the converted layers of `model` run pure FAVOR (no sinks, no window)."""
    from .conversion import converted_modules

    saved = [(m, m.sink_tokens, m.local_window) for m in converted_modules(model).values()]
    try:
        for m, _, _ in saved:
            m.sink_tokens = m.local_window = 0
        yield model
    finally:
        for m, sinks, window in saved:
            m.sink_tokens, m.local_window = sinks, window


def joined(tokenizer, texts: list[str], length: int, max_windows: int = 4):
    """Model inputs of the texts joined by spaces, cut into up to `max_windows` windows of `length` tokens (one
    shorter window when there is less text): long causal-LM sequences for the fidelity report."""
    ids = tokenizer(" ".join(texts), add_special_tokens=False)["input_ids"]
    count = max(1, min(max_windows, len(ids) // length))
    ids = torch.tensor(ids[: count * length] if len(ids) >= length else ids).view(count, -1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def token_windows(tokenizer, texts: list[str], length: int, count: int) -> torch.Tensor:
    """`count` consecutive windows of `length` tokens from the texts joined by blank lines: (count, length).

    Raises `ValueError` when the texts are too short for that many windows.
    """
    ids = []
    for text in texts:
        ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= length * count:
            break
    if len(ids) < length * count:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, fewer than {count} windows of {length}")
    return torch.tensor(ids[: length * count]).view(count, length)


@torch.no_grad()
def lm_report(model, windows: torch.Tensor, reference: list[torch.Tensor] | None = None,
              batch_size: int = 1) -> tuple[dict, list[torch.Tensor]]:
    """Held-out figures of a causal LM on token windows (count, length), each window its own sequence.

    Returns `({"perplexity", and with a reference: "kl", "top1"}, log-probabilities per window)`; pass the
    original model's log-probabilities as `reference` to compare. Perplexity is exp of the mean next-token loss over
    every predicted token; KL(original || converted) and top-1 agreement are means over every position.
    """
    nll, count, kl, agree, logprobs = 0.0, 0, 0.0, 0.0, []
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start : start + batch_size].to(model.device)
        logp = model(input_ids=ids).logits.float().log_softmax(-1).cpu()  # (b, L, V)
        nll -= logp[:, :-1].gather(-1, ids[:, 1:].cpu().unsqueeze(-1)).sum().item()
        count += ids[:, 1:].numel()
        for row in range(ids.shape[0]):
            logprobs.append(logp[row])
            if reference is not None:
                ref = reference[start + row]
                kl += (ref.exp() * (ref - logp[row])).sum().item()
                agree += (ref.argmax(-1) == logp[row].argmax(-1)).sum().item()
    metrics = {"perplexity": float(torch.tensor(nll / count).exp())}
    if reference is not None:
        positions = windows.numel()
        metrics.update(kl=max(kl / positions, 0.0), top1=agree / positions)
    return metrics, logprobs
