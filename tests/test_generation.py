"""Generation with the recurrent FAVOR state, and inputs longer than the pretrained position table."""

import pytest
import torch
from tiny_models import LOCAL, PURE, inputs, tiny_model

import performer_hf
from performer_hf.generation import PerformerCache

GENERATIVE = ["gpt2", "llama", "opt", "gpt_neox", "qwen2", "mistral", "qwen3", "phi3"]
NO_EOS = dict(eos_token_id=None, pad_token_id=0)


def converted(model_type, **kw):
    return performer_hf.convert(tiny_model(model_type), num_features=32, chunk_size=4, **{**PURE, **kw})


HEDGEHOG = {"kernel": "hedgehog", "learned_features": True, "per_head_features": True}


@pytest.mark.parametrize("local", [PURE, LOCAL, HEDGEHOG, {**HEDGEHOG, **LOCAL}],
                         ids=["pure", "local", "hedgehog", "hedgehog-local"])
@pytest.mark.parametrize("model_type", GENERATIVE)
def test_recurrent_steps_equal_recomputing_the_whole_sequence(model_type, local):
    model = converted(model_type, **local)
    ids, _ = inputs(batch=2, length=16)
    cache = PerformerCache()
    with torch.no_grad():
        full = model(ids).logits
        steps = [model(ids[:, :9], past_key_values=cache, use_cache=True).logits]
        for t in range(9, 16):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 16


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
@pytest.mark.parametrize("model_type", GENERATIVE)
def test_greedy_generation_with_the_state_equals_generation_without_a_cache(model_type, local):
    model = converted(model_type, **local)
    ids, _ = inputs(batch=1, length=6)
    with_state = model.generate(ids, max_new_tokens=24, do_sample=False, **NO_EOS)
    recomputed = model.generate(ids, max_new_tokens=24, do_sample=False, use_cache=False, **NO_EOS)
    assert with_state.shape == (1, 30) and torch.equal(with_state, recomputed)


def test_generate_uses_the_constant_size_state():
    model = converted("llama")
    seen = []
    original_forward = model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("past_key_values"))
        return original_forward(*args, **kwargs)

    model.forward = spy
    model.generate(inputs(batch=1, length=4)[0], max_new_tokens=3, do_sample=False, **NO_EOS)
    assert seen and all(isinstance(c, PerformerCache) for c in seen)


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
@pytest.mark.parametrize("model_type", ["gpt2", "llama", "opt"])
def test_batched_left_padded_prompts_match_each_prompt_alone(model_type, local):
    model = converted(model_type, **local)
    ids, _ = inputs(batch=2, length=10, seed=3)
    short = ids[1:, 4:]  # a 6-token prompt, left-padded to 10 in the batch
    batch = ids.clone()
    batch[1, :4] = 0
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    together = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, **NO_EOS)
    alone = model.generate(short, max_new_tokens=12, do_sample=False, **NO_EOS)
    first = model.generate(ids[:1], max_new_tokens=12, do_sample=False, **NO_EOS)
    assert torch.equal(together[1, 4:], alone[0])
    assert torch.equal(together[0], first[0])


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
def test_beam_search_and_sampling(local):
    model = converted("gpt2", **local)
    ids, _ = inputs(batch=1, length=5)
    beams = model.generate(ids, num_beams=3, max_new_tokens=10, do_sample=False, **NO_EOS)
    beams_recomputed = model.generate(ids, num_beams=3, max_new_tokens=10, do_sample=False, use_cache=False,
                                      **NO_EOS)
    assert torch.equal(beams, beams_recomputed)  # reordering the state for beam search is exact
    torch.manual_seed(0)
    sampled = model.generate(ids, do_sample=True, top_k=20, max_new_tokens=10, num_return_sequences=3, **NO_EOS)
    torch.manual_seed(0)
    again = model.generate(ids, do_sample=True, top_k=20, max_new_tokens=10, num_return_sequences=3, **NO_EOS)
    assert sampled.shape == (3, 15) and torch.equal(sampled, again)


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
def test_state_size_is_independent_of_context_length(local):
    model = converted("llama", **local)
    sizes = []
    for length in (8, 64, 120):
        cache = PerformerCache()
        with torch.no_grad():
            model(inputs(batch=1, length=length)[0], past_key_values=cache, use_cache=True)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] == sizes[2] > 0


def test_thousands_of_new_tokens():
    model = converted("llama")
    out = model.generate(inputs(batch=1, length=4)[0], max_new_tokens=2000, do_sample=False, **NO_EOS)
    assert out.shape == (1, 2004)


def test_saved_and_reloaded_models_generate_the_same_tokens(tmp_path):
    model = converted("qwen2")
    ids, _ = inputs(batch=1, length=6)
    before = model.generate(ids, max_new_tokens=16, do_sample=False, **NO_EOS)
    model.save_pretrained(tmp_path)
    again = performer_hf.from_pretrained(str(tmp_path)).eval()
    assert torch.equal(again.generate(ids, max_new_tokens=16, do_sample=False, **NO_EOS), before)


def test_revert_restores_the_softmax_cache():
    model = converted("gpt2")
    performer_hf.revert(model)
    assert "_prepare_cache_for_generation" not in model.__dict__
    ids, _ = inputs(batch=1, length=4)
    assert model.generate(ids, max_new_tokens=4, do_sample=False, **NO_EOS).shape == (1, 8)


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
def test_a_softmax_cache_is_refused_in_one_line(local):
    from transformers import DynamicCache

    model = converted("llama", **local)
    ids, _ = inputs(batch=1, length=6)
    with pytest.raises(ValueError, match="constant-size FAVOR state, not a DynamicCache"):
        model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=DynamicCache(), **NO_EOS)
    with pytest.raises(ValueError, match="constant-size FAVOR state, not a DynamicCache"):
        model(ids, past_key_values=DynamicCache())


@pytest.mark.parametrize("model_type, limit", [("bert", 128), ("roberta", 128), ("gpt2", 128), ("opt", 128),
                                               ("distilbert", 128)])
def test_extended_position_tables_take_longer_inputs(model_type, limit):
    model = tiny_model(model_type)
    short, mask = inputs(batch=1, length=20)
    with torch.no_grad():
        reference = performer_hf.convert(tiny_model(model_type), num_features=16)(input_ids=short).logits
    performer_hf.convert(model, num_features=16, max_position_embeddings=4 * limit)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=short).logits, reference)  # pretrained positions unchanged
        long_out = model(input_ids=torch.randint(3, 90, (1, 3 * limit))).logits
    assert long_out.shape[1] == 3 * limit and torch.isfinite(long_out).all()
    with pytest.raises(ValueError, match=f"{4 * limit + 1} tokens exceed the {4 * limit} positions"):
        with torch.no_grad():
            model(input_ids=torch.randint(3, 90, (1, 4 * limit + 1)))


def test_extended_table_repeats_the_pretrained_one_and_survives_save(tmp_path):
    model = tiny_model("bert")
    old = model.bert.embeddings.position_embeddings.weight.detach().clone()
    performer_hf.convert(model, num_features=16, max_position_embeddings=300)
    new = model.bert.embeddings.position_embeddings.weight
    assert new.shape == (300, old.shape[1]) and model.config.max_position_embeddings == 300
    torch.testing.assert_close(new[128:256], old)
    torch.testing.assert_close(new[256:300], old[:44])
    model.save_pretrained(tmp_path)
    again = performer_hf.from_pretrained(str(tmp_path))
    ids = torch.randint(3, 90, (1, 290))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_rotary_models_raise_their_limit():
    model = converted("llama", max_position_embeddings=4096)
    assert model.config.max_position_embeddings == 4096
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 90, (1, 600))).logits).all()


def test_bad_extensions_are_refused_and_change_nothing():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="shorter than the model's 128 positions"):
        performer_hf.convert(model, max_position_embeddings=64)
    with pytest.raises(ValueError, match="must be a positive integer"):
        performer_hf.convert(model, max_position_embeddings="long")
    assert not performer_hf.is_converted(model) and model.config.max_position_embeddings == 128
    assert model.bert.embeddings.position_embeddings.weight.shape[0] == 128
