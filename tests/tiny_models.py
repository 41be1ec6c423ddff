"""Tiny models of every registered architecture, built from config (no download)."""

from __future__ import annotations

import torch
import transformers
from transformers import AutoConfig

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ROTARY_GQA = dict(num_key_value_heads=2)

CONFIGS = {
    "bert": {},
    # as in the real checkpoints: pad id 1, positions start after it (128 usable of 130)
    "roberta": {"max_position_embeddings": 130, "pad_token_id": 1, "bos_token_id": 0},
    "xlm-roberta": {"max_position_embeddings": 130, "pad_token_id": 1, "bos_token_id": 0},
    "camembert": {"max_position_embeddings": 130, "pad_token_id": 1, "bos_token_id": 0},
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64},
    "electra": {"embedding_size": 16},
    "albert": {"embedding_size": 16},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "gpt_neox": {"rotary_pct": 0.5},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32, "enable_bias": True},
    "llama": ROTARY_GQA,
    "mistral": {**ROTARY_GQA, "sliding_window": None},
    "qwen2": ROTARY_GQA,
    "qwen3": {**ROTARY_GQA, "head_dim": 8},
    "phi3": {**ROTARY_GQA, "partial_rotary_factor": 0.5},
}

HEADS = {  # the LM head of each, then the other head classes tested
    "bert": "BertForMaskedLM",
    "roberta": "RobertaForMaskedLM",
    "xlm-roberta": "XLMRobertaForMaskedLM",
    "camembert": "CamembertForMaskedLM",
    "distilbert": "DistilBertForMaskedLM",
    "electra": "ElectraForMaskedLM",
    "albert": "AlbertForMaskedLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "opt": "OPTForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Causal models convert by default with exact sinks and a 128-token window, which covers the short test sequences
# entirely; tests of the FAVOR path itself ask for pure FAVOR, or for a window shorter than their inputs.
PURE = dict(sink_tokens=0, local_window=0)
LOCAL = dict(sink_tokens=2, local_window=3)
CAUSAL = {"gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "qwen3", "phi3"}


def tiny_config(model_type: str, **overrides):
    kwargs = {**COMMON, **CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, head: str | None = None, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cls = getattr(transformers, head or HEADS[model_type])
    return cls(tiny_config(model_type, **overrides)).eval()


QUERY_KEYS = ("query.weight", "q_lin.weight", "q_proj.weight", "q_norm.weight", "k_norm.weight")


def sharpen_attention(model, factor: float) -> None:
    """Scale the query weights: factor < 1 makes attention near-uniform, where few features suffice."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(key in name for key in QUERY_KEYS):
                param.mul_(factor)
            elif "c_attn.weight" in name:  # GPT-2's fused Conv1D: the first third of the output columns is q
                param[:, : param.shape[1] // 3].mul_(factor)
            elif "query_key_value.weight" in name:  # GPT-NeoX: per head [q, k, v] rows
                heads = model.config.num_attention_heads
                view = param.view(heads, 3, -1, param.shape[-1])
                view[:, 0].mul_(factor)
            elif "qkv_proj.weight" in name:  # Phi-3: q rows first
                cfg = model.config
                q_rows = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
                param[:q_rows].mul_(factor)


def inputs(batch=2, length=12, seed=0, pad_last=0, left=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad_last:
        if left:
            mask[-1, :pad_last] = 0
            ids[-1, :pad_last] = 0
        else:
            mask[-1, -pad_last:] = 0
            ids[-1, -pad_last:] = 0
    return ids, mask


def tiny_tokenizer(model_type: str = "bert"):
    """A lowercase character-level fast tokenizer within VOCAB ids (built locally, no download): every text is
    covered, so tokens are diverse and attention has something to do."""
    import string

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    roberta_like = model_type in ("roberta", "xlm-roberta", "camembert")
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta_like else ["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                                                  "[MASK]"]
    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation + " "))
    vocab = {token: i for i, token in enumerate(special + chars)}
    assert len(vocab) <= VOCAB
    pad, unk, cls, sep, mask = (("<pad>", "<unk>", "<s>", "</s>", "<mask>") if roberta_like
                                else ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if model_type in CAUSAL:
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, pad_token=pad, eos_token=sep,
                                       bos_token=cls, model_max_length=128)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, pad_token=pad, cls_token=cls,
                                   sep_token=sep, mask_token=mask, model_max_length=128)


def save_tiny(directory, model_type: str = "bert", head: str | None = None, **overrides):
    """Save a tiny model and its tokenizer as a local checkpoint directory; returns its path as a string."""
    tiny_model(model_type, head=head, **overrides).save_pretrained(directory)
    tiny_tokenizer(model_type).save_pretrained(directory)
    return str(directory)
