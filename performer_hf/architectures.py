"""What performer_hf knows about each architecture, as data keyed by `config.model_type`.

Q/K/V layout quirks (GPT-2's fused Conv1D, grouped-query heads, rotary embeddings, OPT's pre-scaled queries) need no
entry: every supported model computes its own q, k, v and calls the attention interface with them. What an entry
records is which modules are self-attention, where the learned position table lives (for the length check and its
extension), and what the conversion changes beyond the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureSpec:
    """One supported `model_type`.

    Attributes:
        attention_classes: class names of its self-attention modules (modules flagged `is_cross_attention` are
            left exact).
        position_table: dotted path, below the base model, of the learned absolute position embedding; None for
            rotary models, which have no table.
        position_offset: rows of `max_position_embeddings` that are not positions (RoBERTa's padding offset;
            OPT keeps its offset of 2 outside `max_position_embeddings`).
        notes: what differs from the original model beyond the kernel, shown in the README table.
    """

    model_type: str
    attention_classes: tuple[str, ...]
    position_table: str | None = None
    position_offset: str | int = 0
    notes: str = ""


_BERT_LIKE = dict(position_table="embeddings.position_embeddings")
_ROBERTA_LIKE = dict(position_table="embeddings.position_embeddings", position_offset="pad_token_id+1")
_SLIDING = "sliding-window layers become global (FAVOR attends to the whole prefix)"

SUPPORTED: dict[str, ArchitectureSpec] = {
    spec.model_type: spec
    for spec in (
        ArchitectureSpec("bert", ("BertSelfAttention",), **_BERT_LIKE),
        ArchitectureSpec("roberta", ("RobertaSelfAttention",), **_ROBERTA_LIKE),
        ArchitectureSpec("xlm-roberta", ("XLMRobertaSelfAttention",), **_ROBERTA_LIKE),
        ArchitectureSpec("camembert", ("CamembertSelfAttention",), **_ROBERTA_LIKE),
        ArchitectureSpec("distilbert", ("DistilBertSelfAttention",), **_BERT_LIKE),
        ArchitectureSpec("electra", ("ElectraSelfAttention",), **_BERT_LIKE),
        ArchitectureSpec("albert", ("AlbertAttention",), **_BERT_LIKE, notes="layers share weights and projections"),
        ArchitectureSpec("gpt2", ("GPT2Attention",), position_table="wpe",
                         notes="reorder_and_upcast_attn has no effect (FAVOR always accumulates in fp32)"),
        ArchitectureSpec("gpt_neox", ("GPTNeoXAttention",), notes="fused query_key_value, partial rotary"),
        ArchitectureSpec("opt", ("OPTAttention",), position_table="decoder.embed_positions"),
        ArchitectureSpec("llama", ("LlamaAttention",), notes="rotary, grouped-query heads"),
        ArchitectureSpec("mistral", ("MistralAttention",), notes=f"rotary, grouped-query heads; {_SLIDING}"),
        ArchitectureSpec("qwen2", ("Qwen2Attention",), notes=f"rotary, grouped-query heads; {_SLIDING}"),
        ArchitectureSpec("qwen3", ("Qwen3Attention",), notes=f"rotary, q/k norms, grouped-query heads; {_SLIDING}"),
        ArchitectureSpec("phi3", ("Phi3Attention",), notes=f"rotary (partial), grouped-query heads; {_SLIDING}"),
    )
}

# every class `convert` gives a FAVOR module (a module of these classes without one was not converted)
SELF_ATTENTION_CLASSES = frozenset(name for spec in SUPPORTED.values() for name in spec.attention_classes)

# Model types that cannot be converted faithfully, and why. Anything neither here nor in SUPPORTED is refused as
# unknown.
REFUSED: dict[str, str] = {
    "gpt_neo": "its attention does not go through the transformers attention interface (it is computed inline), "
    "so it cannot be swapped without patching the model's code",
    "bloom": "ALiBi position biases are added to the attention logits, which a softmax feature map cannot express",
    "falcon": "ALiBi (in some checkpoints) and an attention not routed through the attention interface",
    "mpt": "ALiBi position biases are added to the attention logits",
    "t5": "relative position biases are added to the attention logits",
    "mt5": "relative position biases are added to the attention logits",
    "longt5": "relative position biases and local/transient-global attention",
    "deberta": "disentangled relative-position attention adds content-position terms to the logits",
    "deberta-v2": "disentangled relative-position attention adds content-position terms to the logits",
    "gemma2": "attention logit soft-capping (tanh of the logits) has no random-feature form",
    "gpt_oss": "attention sinks add learned logits outside the softmax kernel",
    "transfo-xl": "relative position biases are added to the attention logits",
    "xlnet": "two-stream relative attention",
}


def supported_types() -> list[str]:
    return sorted(SUPPORTED)


def lookup(model_type: str) -> ArchitectureSpec:
    """The spec of `model_type`, or a ValueError that names it, says why, and lists what is supported."""
    if model_type in SUPPORTED:
        return SUPPORTED[model_type]
    supported = ", ".join(supported_types())
    if model_type in REFUSED:
        raise ValueError(f"model type {model_type!r} cannot be converted: {REFUSED[model_type]}. "
                         f"Supported: {supported}")
    raise ValueError(f"model type {model_type!r} is not supported by performer_hf. Supported: {supported}")


def position_limit(spec: ArchitectureSpec, config) -> int | None:
    """How many positions the learned table covers (None for rotary models)."""
    if spec.position_table is None:
        return None
    offset = spec.position_offset
    if offset == "pad_token_id+1":
        offset = (config.pad_token_id or 0) + 1
    return config.max_position_embeddings - offset


def markdown_table() -> str:
    """The README's supported-architectures table, generated from the registry."""
    lines = ["| model_type | self-attention modules | positions | notes |", "|---|---|---|---|"]
    for name in supported_types():
        spec = SUPPORTED[name]
        positions = f"learned table `{spec.position_table}`" if spec.position_table else "rotary"
        lines.append(f"| `{name}` | {', '.join(spec.attention_classes)} | {positions} | {spec.notes} |")
    lines += ["", "| refused model_type | why |", "|---|---|"]
    lines += [f"| `{name}` | {why} |" for name, why in sorted(REFUSED.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m performer_hf.architectures > table for the README
    print(markdown_table(), end="")
