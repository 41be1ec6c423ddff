"""Generation with a constant-size recurrent state.

`PerformerCache` is a transformers `Cache` whose layers keep the causal FAVOR state (sum phi(k) [v, 1]^T and the
running key stabiliser) instead of keys and values. Each attention module still calls `cache.update(k, v)`; the
layer only counts the tokens and hands back the new keys and values, and the attention function continues the
layer's state from them: prefill runs the chunked form, every new token is one recurrent step. Memory does not grow
with the context.

A converted causal model uses it in `generate()` without being asked: `convert` gives the model instance its own
`_prepare_cache_for_generation`, which supplies a `PerformerCache` where generate would build its default dynamic
cache, and a forward pre-hook that points the model's FAVOR modules at the cache of the current call. `revert`
removes both. (This instance-level override is the one place performer_hf leans on a private transformers method;
it lives here alone.)
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import FavorAttention


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

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def _point_at_cache(favors):
    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        cache = cache if isinstance(cache, PerformerCache) else None
        for favor in favors:
            favor.generation_cache = cache

    return hook


def _forget_cache(favors):
    def hook(module, args, kwargs, output):
        for favor in favors:
            favor.generation_cache = None

    return hook


def install(model, favors: list[FavorAttention]) -> list:
    """Make `model.generate` use a `PerformerCache`; returns the hook handles (removed by `uninstall`)."""
    handles = [model.register_forward_pre_hook(_point_at_cache(favors), with_kwargs=True),
               model.register_forward_hook(_forget_cache(favors), with_kwargs=True)]
    original = getattr(type(model), "_prepare_cache_for_generation", None)
    if original is None or not hasattr(model, "generate"):  # a base model: no generate() to serve
        return handles

    def _prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs):
        wants_default = (model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False
                         and generation_config.cache_implementation in (None, "dynamic"))
        if wants_default:
            model_kwargs["past_key_values"] = PerformerCache()
            return None
        return original(model, generation_config, model_kwargs, *args, **kwargs)

    model.__dict__["_prepare_cache_for_generation"] = _prepare_cache_for_generation
    return handles


def uninstall(model) -> None:
    model.__dict__.pop("_prepare_cache_for_generation", None)
