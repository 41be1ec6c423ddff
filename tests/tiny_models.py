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
CAUSAL = {"gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "qwen3", "phi3"}


def tiny_config(model_type: str, **overrides):
    kwargs = {**COMMON, **CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, head: str | None = None, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cls = getattr(transformers, head or HEADS[model_type])
    return cls(tiny_config(model_type, **overrides)).eval()


def sharpen_attention(model, factor: float) -> None:
    """Scale the query weights: factor < 1 makes attention near-uniform, where few features suffice."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(key in name for key in ("query.weight", "q_lin.weight", "q_proj.weight", "q_norm.weight", "k_norm.weight")):
                param.mul_(factor)
            elif "c_attn.weight" in name:  # GPT-2's fused Conv1D: the first third of the output columns is q
                param[:, : param.shape[1] // 3].mul_(factor)
            elif "query_key_value.weight" in name:  # GPT-NeoX: per head [q, k, v] rows
                heads = model.config.num_attention_heads
                view = param.view(heads, 3, -1, param.shape[-1])
                view[:, 0].mul_(factor)
            elif "qkv_proj.weight" in name:  # Phi-3: q rows first
                q_rows = model.config.num_attention_heads * (model.config.hidden_size // model.config.num_attention_heads)
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
