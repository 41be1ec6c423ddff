"""Generation with a constant-size recurrent state, and the guard every converted model carries.

`PerformerCache` is a transformers `Cache` whose layers keep the causal FAVOR state (sum phi(k) [v, 1]^T and the
running key stabiliser, plus sink and window keys/values with a local window) instead of keys and values. Each
attention module still calls `cache.update(k, v, layer_idx)`; the cache hands back only the new keys and values and
passes its layer on to the attention function called next (`attention.hand_over`), which continues the layer's state:
prefill runs the chunked form, every new token is one recurrent step. Memory does not grow with the context.

`convert` installs, on the model instance and nowhere else:
- a forward pre-hook on the decoder or base model (`_guard`): it refuses what would silently give another model's answer
  (attention switched away from "performer", `output_attentions`, a softmax cache), and in causal models builds a
  `PerformerCache` when `use_cache` asks for one and none was given, so every caller of `forward` (generate, a
  manual decoding loop, a pipeline) gets the constant-size state;
- `_prepare_cache_for_generation`, which makes `generate()` start from a `PerformerCache` and refuses other cache
  implementations (this instance-level override is the one place performer_hf leans on a private transformers
  method; it lives here alone);
- `set_attn_implementation`, which refuses anything but "performer" until `performer_hf.revert`.
All three are module-level functions or small objects holding the model, never closures, so `copy.deepcopy` and
`torch.save` give a copy that refers to itself, not to the original. `revert` removes them.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import ATTN_IMPLEMENTATION, hand_over, tracing
from .config import CONFIG_KEY


class FavorCacheLayer(CacheLayerMixin):
    """One layer's recurrent state, in place of its keys and values: a `FavorState`, or with sinks and a local window
    a `LocalState` (the FAVOR sums plus the sink and window keys/values)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state = None
        self.seen = 0  # tokens folded into the state so far (padding included, as positions count them)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states  # only the new tokens: the past lives in `state`

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def _map(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map_tensors(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a FAVOR state cannot be cropped: tokens are folded into sums and cannot be taken out")

    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()


class PerformerCache(Cache):
    """The generation cache of a converted causal model: constant size, whatever the context length.

    Example:
        >>> cache = PerformerCache()
        >>> out = model(input_ids, past_key_values=cache)  # doctest: +SKIP
        >>> cache.nbytes()  # the same after 10 tokens or 10,000  # doctest: +SKIP
    """

    def __init__(self, **kwargs):
        super().__init__(layer_class_to_replicate=FavorCacheLayer)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        hand_over(layer_idx, self.layers[layer_idx])  # the attention function called next continues its state
        return keys, values

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


_NOT_CONVERTED = "call performer_hf.revert(model) first to get the softmax model back"


def _argument(module, args: tuple, kwargs: dict, name: str):
    """(value, position in args or None) of a forward argument given by keyword or by position."""
    if name in kwargs or not args:
        return kwargs.get(name), None
    names = list(inspect.signature(module.forward).parameters)
    index = names.index(name) if name in names else len(args)
    return (args[index], index) if index < len(args) else (None, None)


def _guard(module, args, kwargs, *, causal: bool):
    """Forward pre-hook of a converted base model; see the module docstring."""
    config = module.config
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"this converted model's attention implementation was switched to "
                         f"{config._attn_implementation!r}, which would run softmax attention with the FAVOR modules "
                         f"ignored; use set_attn_implementation('performer'), or {_NOT_CONVERTED}")
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        raise ValueError("FAVOR attention never forms the attention matrix, so output_attentions=True has nothing to "
                         f"return; to inspect softmax attention weights, {_NOT_CONVERTED} (or load the original)")
    hand_over(None, None)  # nothing left over from an interrupted call
    if module.training and not module.__dict__.get("_performer_redraws_applied"):
        interval = ((getattr(config, CONFIG_KEY, None) or {}).get("settings") or {}).get("redraw_interval")
        if interval:
            warnings.warn(f"this model's redraw_interval ({interval}) is applied by `performer-hf finetune`; a "
                          "training loop of your own redraws nothing unless it calls "
                          "performer_hf.redraw_projections (with transformers' Trainer: "
                          "callbacks=[performer_hf.RedrawCallback()])", stacklevel=2)
            module.__dict__["_performer_redraws_applied"] = True  # said once
    if not causal or getattr(config, "add_cross_attention", False):  # decoders with cross-attention: softmax caches
        return None
    past, position = _argument(module, args, kwargs, "past_key_values")
    if tracing() and past is None and _argument(module, args, kwargs, "attention_mask")[0] is None \
            and _argument(module, args, kwargs, "position_ids")[0] is None:
        # While tracing, transformers cannot rule out packed sequences from its own default positions and asks for
        # a packed-sequence mask; an explicit all-real padding mask says what is true: one sequence per row.
        tokens = _argument(module, args, kwargs, "input_ids")[0]
        tokens = _argument(module, args, kwargs, "inputs_embeds")[0] if tokens is None else tokens
        if tokens is not None:
            kwargs["attention_mask"] = torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)
    if past is None:
        use_cache, _ = _argument(module, args, kwargs, "use_cache")
        use_cache = config.use_cache if use_cache is None else use_cache
        if not use_cache or module.training or tracing():
            return args, kwargs  # training and tracing build no state (transformers' own choice applies)
        if position is not None:
            args = (*args[:position], PerformerCache(), *args[position + 1:])
        else:
            kwargs["past_key_values"] = PerformerCache()
        return args, kwargs
    if not isinstance(past, PerformerCache):
        raise ValueError(f"a converted model keeps a constant-size FAVOR state, not a {type(past).__name__} (whose "
                         "keys and values it cannot use); leave past_key_values out (use_cache=True builds a "
                         "performer_hf.PerformerCache) or pass the past_key_values a previous call returned")
    return None


class _PrepareCache:
    """`generate()`'s cache preparation: a `PerformerCache` where generate would build its dynamic cache."""

    def __init__(self, model):
        self.model = model

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        implementation = generation_config.cache_implementation
        if implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={implementation!r} keeps softmax keys and values, which a "
                             "converted model cannot use; leave cache_implementation unset (the constant-size "
                             "PerformerCache is used)")
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            model_kwargs["past_key_values"] = PerformerCache()
            return None
        return type(self.model)._prepare_cache_for_generation(self.model, generation_config, model_kwargs, *args,
                                                              **kwargs)


class _SetAttnImplementation:
    """`set_attn_implementation` of a converted model: "performer" only, until `performer_hf.revert`."""

    def __init__(self, model):
        self.model = model

    def __call__(self, attn_implementation, *args, **kwargs):
        if attn_implementation not in (ATTN_IMPLEMENTATION, {"": ATTN_IMPLEMENTATION}):
            raise ValueError(f"set_attn_implementation({attn_implementation!r}) on a converted model would silently "
                             f"bring softmax attention back; {_NOT_CONVERTED}")
        return type(self.model).set_attn_implementation(self.model, attn_implementation, *args, **kwargs)


def install(model, causal: bool) -> None:
    """Install the guard hook and the instance overrides on a converted `model` (removed by `uninstall`)."""
    # the module that builds the cache: the decoder (OPT's causal LM calls model.decoder directly), else the base
    owner = model.get_decoder() if causal and hasattr(model, "get_decoder") else None
    owner = owner if isinstance(owner, PreTrainedModel) else model.base_model
    owner.register_forward_pre_hook(functools.partial(_guard, causal=causal), with_kwargs=True)
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.__dict__["set_attn_implementation"] = _SetAttnImplementation(module)
    if causal and getattr(type(model), "_prepare_cache_for_generation", None) is not None:
        model.__dict__["_prepare_cache_for_generation"] = _PrepareCache(model)


def remove_pre_hooks(model, function) -> None:
    """Remove every forward pre-hook that is `functools.partial(function, ...)` from `model` and its submodules
    (found by what they are, so a copy of the model loses its own hooks, not the original's)."""
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for key in [k for k, hook in hooks.items() if getattr(hook, "func", None) is function]:
            del hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)


def uninstall(model) -> None:
    remove_pre_hooks(model, _guard)
    for module in model.modules():
        module.__dict__.pop("set_attn_implementation", None)
    model.__dict__.pop("_prepare_cache_for_generation", None)
