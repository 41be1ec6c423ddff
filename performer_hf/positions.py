"""Longer inputs than the pretrained model saw: extend learned absolute position tables.

The new table repeats the pretrained one (the recipe Longformer used to start from RoBERTa), so every position keeps
a pretrained embedding and the first positions are unchanged. Positions past the original length were never trained
in context: fine-tune at the new length. Rotary models have no table; their config limit is raised and the
rotations extrapolate.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .architectures import ArchitectureSpec, position_limit


def _table(model, spec: ArchitectureSpec) -> tuple[nn.Module, nn.Embedding, int]:
    """(parent module, embedding, leading non-position rows) of the learned position table."""
    parent_path, _, attr = spec.position_table.rpartition(".")
    parent = model.base_model.get_submodule(parent_path)  # get_submodule("") is the base model itself
    table = getattr(parent, attr)
    lead = table.num_embeddings - position_limit(spec, model.config)  # rows before position 0 (RoBERTa, OPT)
    return parent, table, lead


def check_extension(model, spec: ArchitectureSpec, length: int) -> None:
    """Raise a ValueError if the model cannot take inputs of `length` tokens by extension; change nothing."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"max_position_embeddings must be a positive integer, got {length!r}")
    limit = position_limit(spec, model.config)
    if limit is not None and length < limit:
        raise ValueError(f"max_position_embeddings={length} is shorter than the model's {limit} positions; "
                         "shrinking the table is not supported")
    if spec.position_table is not None:
        _, table, _ = _table(model, spec)
        if not isinstance(table, nn.Embedding):
            raise ValueError(f"{spec.model_type}: the position table is a {type(table).__name__}, not a learned "
                             "embedding, so it cannot be extended")


def extend(model, spec: ArchitectureSpec, length: int) -> None:
    """Let `model` take `length` tokens: tile its learned position table, or raise a rotary model's limit."""
    config = model.config
    if spec.position_table is None:
        if length > config.max_position_embeddings:
            rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
            kind = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
            if kind != "default":
                warnings.warn(f"{spec.model_type} uses {kind!r} rope scaling tuned for its original length; "
                              f"positions up to {length} are extrapolated. Fine-tune at the new length.", stacklevel=3)
            config.max_position_embeddings = length
        return
    limit = position_limit(spec, config)
    if length == limit:
        return
    parent, table, lead = _table(model, spec)
    old = table.weight.data
    positions = old[lead:]  # (limit, d)
    repeats = -(-length // positions.shape[0])
    new_weight = torch.cat([old[:lead], positions.repeat(repeats, 1)[:length]], dim=0)
    table.weight = nn.Parameter(new_weight, requires_grad=table.weight.requires_grad)
    table.num_embeddings = new_weight.shape[0]
    for name, buffer in list(parent.named_buffers(recurse=False)):  # BERT-style position_ids / token_type_ids
        if buffer.dim() == 2 and buffer.shape[-1] == old.shape[0]:
            if name == "position_ids":
                fresh = torch.arange(new_weight.shape[0], device=buffer.device, dtype=buffer.dtype)[None]
            else:
                fresh = torch.zeros(1, new_weight.shape[0], device=buffer.device, dtype=buffer.dtype)
            parent.register_buffer(name, fresh, persistent=name in parent.state_dict())
    config.max_position_embeddings = config.max_position_embeddings + (length - limit)
