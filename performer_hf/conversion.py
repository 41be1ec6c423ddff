"""Convert a loaded transformers model to FAVOR attention in place, revert it, save and load it.

The steps follow one rule: validate everything before changing anything, so that a refused conversion leaves the
model exactly as it was. Walk (find the self-attention modules) -> check (architecture, head sizes, not converted
yet) -> attach (one `FavorAttention` per module, then switch the attention implementation).
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

from . import attention, generation, positions
from .architectures import ArchitectureSpec, lookup, position_limit
from .attention import ATTN_IMPLEMENTATION, FavorAttention
from .config import CONFIG_KEY, FORMAT_VERSION, PerformerConfig

_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder")
_FAVOR_MARK = ".performer."  # every tensor a FavorAttention saves (projection, FAVOR++ A, learned scales)


def converted_modules(model: torch.nn.Module) -> dict[str, FavorAttention]:
    """The FAVOR modules of a converted model, by the name of the attention module that owns each."""
    return {name.removesuffix(".performer"): m for name, m in model.named_modules() if isinstance(m, FavorAttention)}


def is_converted(model: torch.nn.Module) -> bool:
    return bool(converted_modules(model))


def _find_attention(model: PreTrainedModel, spec: ArchitectureSpec) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__ in spec.attention_classes and not getattr(module, "is_cross_attention", False)
    ]


def _num_heads(module: torch.nn.Module, config) -> int:
    for attr in ("num_heads", "num_attention_heads", "n_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return int(config.num_attention_heads)


def _head_dim(module: torch.nn.Module, config) -> int:
    for attr in ("head_dim", "attention_head_size"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(value)


def _check_length(module, args, kwargs, *, limit: int, model_type: str):
    """Forward pre-hook of models with a learned position table (a module-level function: copies stay right)."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None or tokens.dim() < 2:
        return
    past = kwargs.get("past_key_values")
    seen = past.get_seq_length() if past is not None and hasattr(past, "get_seq_length") else 0
    if seen + tokens.shape[1] > limit:
        raise ValueError(
            f"{seen + tokens.shape[1]} tokens exceed the {limit} positions of this {model_type} model's learned "
            f"position table; truncate the input, or convert with max_position_embeddings=N to extend the table "
            f"(then fine-tune at the new length)."
        )


def convert(model: PreTrainedModel, config: PerformerConfig | None = None, *,
            max_position_embeddings: int | None = None, calibration=None, **overrides: Any) -> PreTrainedModel:
    """Give every self-attention layer of `model` a FAVOR module, in place, reusing its Q/K/V/O weights untouched.

    Args:
        model (`PreTrainedModel`): a loaded transformers model of a supported `model_type` (any head class).
        config (`PerformerConfig`, *optional*): the settings; defaults to `PerformerConfig()` (for causal models:
            exact attention to 4 sink tokens and the 128 most recent keys, FAVOR for the rest; for bidirectional
            models: pure FAVOR).
        max_position_embeddings (`int`, *optional*): accept inputs of this many tokens: learned absolute position
            tables are extended by repeating the pretrained table (fine-tune at the new length afterwards); rotary
            models get the higher limit in their config.
        calibration (`dict` or `torch.Tensor`, *optional*): model inputs (a tokenizer's output, or input ids) run
            once through the model to fix FAVOR++'s A per layer and head; required for `kernel="favor++"`.
        overrides: fields of `PerformerConfig` to change, e.g. `num_features=512`.

    Returns:
        The same model object, converted. `performer_hf.converted_modules(model)` lists what changed and
        `performer_hf.revert(model)` undoes it.

    Raises:
        ValueError: unsupported architecture, already converted, or bad settings. The model is left untouched.

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...                              intermediate_size=128))
        >>> model = convert(model, num_features=32)
        >>> sorted(converted_modules(model))
        ['encoder.layer.0.attention.self', 'encoder.layer.1.attention.self']
    """
    config = (config or PerformerConfig()).replace(**overrides) if overrides else (config or PerformerConfig())
    if config.kernel == "favor++" and calibration is None:
        raise ValueError("favor++ fixes its A per layer and head from calibration text: pass "
                         "calibration=tokenizer(texts, return_tensors='pt', padding=True) to convert")
    if calibration is not None:
        calibration = _calibration_inputs(calibration)
    _convert(model, config, max_position_embeddings)
    if config.kernel == "favor++":
        try:
            calibrate(model, calibration)
        except Exception:
            revert(model)  # never leave a half-converted model behind
            raise
    return model


def _convert(model: PreTrainedModel, config: PerformerConfig, max_position_embeddings: int | None = None):
    # --- check ---
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"convert takes a transformers PreTrainedModel, got {type(model).__name__}")
    spec = lookup(model.config.model_type)
    if is_converted(model):
        raise ValueError("this model is already converted; call performer_hf.revert(model) first to convert it "
                         "again, or performer_hf.redraw_projections(model) for fresh projections")
    if not model._can_set_attn_implementation():
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation, so it cannot be "
                         "converted")
    targets = _find_attention(model, spec)
    if not targets:
        raise ValueError(f"found no self-attention module ({', '.join(spec.attention_classes)}) in "
                         f"{type(model).__name__}")
    head_dims = [_head_dim(module, model.config) for _, module in targets]
    num_heads = [_num_heads(module, model.config) for _, module in targets]
    causal = any(getattr(module, "is_causal", False) for _, module in targets)
    config = config.resolved(causal)
    if max_position_embeddings is not None:
        positions.check_extension(model, spec, max_position_embeddings)
    window = getattr(model.config, "sliding_window", None)
    if window is not None and getattr(model.config, "use_sliding_window", True):
        warnings.warn(f"this {spec.model_type} model attends within a sliding window of {window} tokens; FAVOR "
                      f"attention covers the whole prefix, so outputs differ from the original beyond {window} "
                      "tokens", stacklevel=3)

    # --- attach ---
    attention.register()
    if max_position_embeddings is not None:
        positions.extend(model, spec, max_position_embeddings)
    generator = torch.Generator().manual_seed(config.seed)
    for (_, module), head_dim, heads in zip(targets, head_dims, num_heads, strict=True):
        device = next(module.parameters()).device
        module.performer = FavorAttention(config, head_dim, heads, generator=generator).to(device)
    previous = model.config._attn_implementation
    meta = dict(getattr(model.config, CONFIG_KEY, None) or {})
    model.config.__dict__[CONFIG_KEY] = {
        **meta,  # what an earlier conversion recorded (e.g. the GGUF file of the base model) is kept
        "format_version": FORMAT_VERSION,
        "settings": config.to_dict(),
        # a reloaded Performer keeps the base it recorded, never its own directory
        "base_model": meta["base_model"] if "base_model" in meta else model.config._name_or_path or None,
        "original_attn_implementation": meta.get("original_attn_implementation") or previous,
        "converted_modules": [name for name, _ in targets],
    }
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    # saved in config.json: a plain transformers load then asks for "performer" (an error without performer_hf, a
    # one-line error at the first forward with it) instead of silently running softmax attention
    model.config.__dict__["attn_implementation"] = ATTN_IMPLEMENTATION
    limit = position_limit(spec, model.config)
    if limit is not None:
        model.register_forward_pre_hook(functools.partial(_check_length, limit=limit, model_type=spec.model_type),
                                        with_kwargs=True)
    generation.install(model, causal)
    return model


def _calibration_inputs(inputs) -> dict:
    if torch.is_tensor(inputs):
        inputs = {"input_ids": inputs}
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError("calibration must be a (batch, length) tensor of input ids or a tokenizer's output with "
                         "input_ids (return_tensors='pt')")
    return {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


@torch.no_grad()
def calibrate(model: PreTrainedModel, inputs) -> None:
    """Fix FAVOR++'s A of every converted layer from `inputs` (model inputs or input ids), run once with exact
    attention so that each layer sees the original model's hidden states. Outputs then never depend on the
    current sequence's statistics: causal favor++ is prefix-invariant and generation equals recomputation."""
    favors = [m for m in converted_modules(model).values() if m.kernel == "favor++"]
    inputs = {k: v.to(model.device) for k, v in _calibration_inputs(inputs).items()}
    for favor in favors:
        favor.mode, favor._moments = "calibrate", None
    try:
        model(**inputs)
        for favor in favors:
            favor.finish_calibration()
    finally:
        for favor in favors:
            favor.mode = "favor"


def revert(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `convert` in place: drop the FAVOR modules and restore the original attention implementation."""
    modules = converted_modules(model)
    if not modules:
        raise ValueError("this model is not converted: nothing to revert")
    for name in modules:
        owner = model.get_submodule(name)
        del owner.performer
    generation.remove_pre_hooks(model, _check_length)
    generation.uninstall(model)
    meta = model.config.__dict__.pop(CONFIG_KEY, None) or {}
    model.config.__dict__.pop("attn_implementation", None)
    model.set_attn_implementation(meta.get("original_attn_implementation") or "sdpa")
    return model


def redraw_projections(model: torch.nn.Module, generator: torch.Generator | None = None) -> int:
    """Draw fresh projections for every converted layer; returns how many were redrawn (learned projections are
    trained, never redrawn).

    Pass the same seeded generator on every process to keep replicas identical.
    """
    modules = converted_modules(model)
    if not modules:
        raise ValueError("this model is not converted: there are no projections to redraw")
    return sum(module.redraw(generator) for module in modules.values())


def mark_redraws_applied(model: torch.nn.Module) -> None:
    """Record that a training loop redraws this model's projections (no warning about `redraw_interval` then)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.__dict__["_performer_redraws_applied"] = True


def performer_settings(config) -> PerformerConfig | None:
    """The `PerformerConfig` saved in a transformers config, or None for an unconverted model."""
    meta = getattr(config, CONFIG_KEY, None)
    if not isinstance(meta, dict) or "settings" not in meta:
        return None
    return PerformerConfig.from_dict(meta["settings"])


def _weight_files(path: str, hub_kwargs: dict) -> list[str]:
    single = cached_file(path, SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    if single is not None:
        return [single]
    index = cached_file(path, SAFE_WEIGHTS_INDEX_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    if index is None:
        raise ValueError(f"{path} has no safetensors weights ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME})")
    with open(index) as f:
        shards = sorted({file for key, file in json.load(f)["weight_map"].items() if _FAVOR_MARK in key})
    return [cached_file(path, shard, **hub_kwargs) for shard in shards]


def _load_projections(model: PreTrainedModel, path: str, hub_kwargs: dict) -> None:
    """Load every layer's saved FAVOR tensors (projection, FAVOR++ A, learned scales), checking shape, dtype and
    finiteness first."""
    wanted = {f"{name}.performer.{key}": tensor for name, module in converted_modules(model).items()
              for key, tensor in module.state_dict(keep_vars=True).items()}
    found, where = {}, {}
    for file in _weight_files(path, hub_kwargs):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if _FAVOR_MARK in key:
                        found[key], where[key] = f.get_tensor(key), file
        except Exception as err:  # safetensors' own error type
            raise ValueError(f"{file} is truncated or corrupt ({str(err).strip()[:200]}); re-save or re-download "
                             "it") from None
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(f"{path} lacks the saved FAVOR tensors of {len(missing)} layers (first: {missing[0]}); "
                         "was it saved with save_pretrained after performer_hf.convert?")
    for key, target in wanted.items():
        tensor = found[key]
        if tuple(tensor.shape) != tuple(target.shape) or not tensor.is_floating_point():
            raise ValueError(f"{where[key]}: {key} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, expected "
                             f"{tuple(target.shape)} floating point; the file does not match its config.json")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where[key]}: {key} holds NaN or infinite values; the checkpoint is corrupt")
    with torch.no_grad():
        for key, target in wanted.items():
            target.copy_(found[key])


class _DropProjectionNotices(logging.Filter):
    """transformers reports the saved projections as unexpected keys of the softmax model; they are not."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _FAVOR_MARK not in record.getMessage()


def from_pretrained(path_or_hub_id: str, **kwargs: Any) -> PreTrainedModel:
    """Load a converted model saved with `save_pretrained` (a local directory or a Hub id).

    Rebuilds the head class named in `config.architectures`, converts it with the saved settings and loads the saved
    projections, so outputs are bit-identical to the model that was saved. `kwargs` go to the model class's
    `from_pretrained` (e.g. `dtype`, `revision`, `token`).

    Example:
        >>> model = performer_hf.from_pretrained("bert-performer")  # doctest: +SKIP
    """
    from .hub import NO_REMOTE_CODE, custom_code_message, refuse_custom_code

    if kwargs.get("trust_remote_code"):
        raise ValueError(custom_code_message(path_or_hub_id))
    kwargs = {**kwargs, **NO_REMOTE_CODE}
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    try:
        config = AutoConfig.from_pretrained(path_or_hub_id, **hub_kwargs, **NO_REMOTE_CODE)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ValueError(custom_code_message(path_or_hub_id)) from None
        raise
    refuse_custom_code(path_or_hub_id, config)
    settings = performer_settings(config)
    if settings is None:
        raise ValueError(
            f"{path_or_hub_id} has no Performer settings in its config.json: it is not a converted model. Load it "
            f"with transformers and call performer_hf.convert(model), or run `performer-hf convert {path_or_hub_id}`."
        )
    architecture = (config.architectures or [None])[0]
    model_class = getattr(transformers, architecture, None) if architecture else None
    if model_class is None:
        raise ValueError(f"{path_or_hub_id}: config.architectures names {architecture!r}, which this transformers "
                         f"({transformers.__version__}) does not provide")
    attention.register()  # config.json asks for attn_implementation="performer"
    quiet = _DropProjectionNotices()
    loggers = [logging.getLogger(n) for n in ("transformers.modeling_utils", "transformers.utils.loading_report")]
    for log in loggers:
        log.addFilter(quiet)
    try:
        model = model_class.from_pretrained(path_or_hub_id, config=config, use_safetensors=True, **kwargs)
    except Exception as err:  # truncated weights, or only a pickle: one line naming the checkpoint
        from .hub import load_error_message

        raise ValueError(load_error_message(path_or_hub_id, err)) from err
    finally:
        for log in loggers:
            log.removeFilter(quiet)
    _convert(model, settings)
    _load_projections(model, path_or_hub_id, hub_kwargs)
    return model
