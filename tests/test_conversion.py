"""Converting tiny models of every registered architecture: weights, outputs, padding, revert, save/load."""

import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import CAUSAL, CONFIGS, LOCAL, PURE, inputs, save_tiny, sharpen_attention, tiny_config, tiny_model

import performer_hf
from performer_hf import PerformerConfig
from performer_hf.architectures import REFUSED, SUPPORTED, markdown_table

ALL = sorted(CONFIGS)
BIDIRECTIONAL = sorted(set(ALL) - CAUSAL)


def logits(model, ids, mask=None, **kw):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kw).logits


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_every_registered_architecture_has_a_tiny_model():
    assert set(ALL) == set(SUPPORTED)


@pytest.mark.parametrize("model_type", ALL)
def test_parameters_are_the_same_tensors(model_type):
    model = tiny_model(model_type)
    before = {name: p for name, p in model.named_parameters()}
    performer_hf.convert(model, num_features=16)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(after[name] is p for name, p in before.items())
    modules = performer_hf.converted_modules(model)
    layers = 1 if model_type == "albert" else 2  # ALBERT shares one attention module across layers
    assert len(modules) == layers
    assert model.config._attn_implementation == "performer"
    assert model.config.performer["converted_modules"] == sorted(modules)


@pytest.mark.parametrize("model_type", ALL)
def test_outputs_approach_the_original_with_many_features(model_type):
    model = tiny_model(model_type)
    sharpen_attention(model, 0.5)  # near-uniform attention: the regime where random features are accurate
    ids, mask = inputs()
    ref = logits(model, ids, mask)
    errors = {}
    for m in (16, 2048):
        performer_hf.convert(model, num_features=m, **PURE)
        errors[m] = rel(logits(model, ids, mask), ref)
        performer_hf.revert(model)
    assert errors[2048] < 0.02, errors
    assert errors[2048] < errors[16], errors


@pytest.mark.parametrize("model_type", BIDIRECTIONAL)
def test_padding_never_changes_real_tokens_bidirectional(model_type):
    model = performer_hf.convert(tiny_model(model_type), num_features=32)
    ids, mask = inputs(pad_last=4)
    padded = logits(model, ids, mask)
    alone = logits(model, ids[-1:, :-4])
    torch.testing.assert_close(padded[-1:, :-4], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
@pytest.mark.parametrize("model_type", sorted(CAUSAL))
def test_causal_prefix_and_left_padding_invariance(model_type, local):
    model = performer_hf.convert(tiny_model(model_type), num_features=32, chunk_size=4, **local)
    ids, _ = inputs(batch=1, length=12)
    full = logits(model, ids)
    prefix = logits(model, ids[:, :7])
    torch.testing.assert_close(full[:, :7], prefix, rtol=1e-4, atol=1e-5)
    # left padding, positions counted from the first real token (as generate does)
    pad = 3
    padded_ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    extra = {} if model_type == "opt" else {"position_ids": position_ids}  # OPT derives positions from the mask
    padded = logits(model, padded_ids, mask, **extra)
    torch.testing.assert_close(padded[:, pad:], full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ALL)
def test_revert_restores_exact_outputs(model_type):
    model = tiny_model(model_type)
    ids, mask = inputs(pad_last=3)
    ref = logits(model, ids, mask)
    original_impl = model.config._attn_implementation
    performer_hf.convert(model, num_features=16, **PURE)
    assert not torch.equal(logits(model, ids, mask), ref)
    performer_hf.revert(model)
    assert torch.equal(logits(model, ids, mask), ref)
    assert model.config._attn_implementation == original_impl
    assert not performer_hf.is_converted(model) and not hasattr(model.config, "performer")
    assert not any("performer" in key for key in model.state_dict())


@pytest.mark.parametrize("model_type", ALL)
def test_save_and_load_are_bit_identical(model_type, tmp_path):
    settings = PerformerConfig(num_features=16, kernel="favor++", seed=7, **LOCAL)
    model = performer_hf.convert(tiny_model(model_type), settings, calibration=inputs(length=20)[0])
    ids, mask = inputs(pad_last=2)
    out = logits(model, ids, mask)
    model.save_pretrained(tmp_path)
    again = performer_hf.from_pretrained(str(tmp_path)).eval()
    assert type(again) is type(model)
    assert performer_hf.performer_settings(again.config) == settings
    assert torch.equal(logits(again, ids, mask), out)


def test_redraw_changes_outputs_and_the_saved_projections_come_back(tmp_path):
    model = performer_hf.convert(tiny_model("bert"), num_features=16)
    ids, mask = inputs()
    saved = logits(model, ids, mask)
    model.save_pretrained(tmp_path)
    assert performer_hf.redraw_projections(model, torch.Generator().manual_seed(123)) == 2
    redrawn = logits(model, ids, mask)
    assert not torch.allclose(redrawn, saved)
    assert torch.equal(logits(model, ids, mask), redrawn)  # forward itself never redraws
    assert torch.equal(logits(performer_hf.from_pretrained(str(tmp_path)).eval(), ids, mask), saved)


def test_same_seed_same_projections_and_layers_differ():
    a = performer_hf.convert(tiny_model("gpt2"), num_features=16, seed=3)
    b = performer_hf.convert(tiny_model("gpt2"), num_features=16, seed=3)
    pa = [m.projection for m in performer_hf.converted_modules(a).values()]
    pb = [m.projection for m in performer_hf.converted_modules(b).values()]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not torch.equal(pa[0], pa[1])


@pytest.mark.parametrize("model_type", ["bert", "gpt2", "llama", "qwen3"])
def test_bf16_forward(model_type):
    model = performer_hf.convert(tiny_model(model_type), num_features=64, **PURE)
    ids, mask = inputs(pad_last=2)
    ref = logits(model, ids, mask)
    out = logits(model.to(torch.bfloat16), ids, mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel(out.float(), ref) < 0.05


@pytest.mark.parametrize(
    "model_type, head",
    [("bert", "BertModel"), ("bert", "BertForSequenceClassification"), ("roberta", "RobertaForTokenClassification"),
     ("gpt2", "GPT2Model"), ("gpt2", "GPT2ForSequenceClassification"), ("llama", "LlamaForSequenceClassification"),
     ("distilbert", "DistilBertForQuestionAnswering"), ("qwen2", "Qwen2Model")],
)
def test_every_head_class_converts_and_reloads(model_type, head, tmp_path):
    model = performer_hf.convert(tiny_model(model_type, head=head), num_features=16)
    ids, mask = inputs()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)[0]
    model.save_pretrained(tmp_path)
    again = performer_hf.from_pretrained(str(tmp_path)).eval()
    assert type(again).__name__ == head
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, attention_mask=mask)[0], out)


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, model.config._attn_implementation


@pytest.mark.parametrize("model_type, head", [("gpt_neo", "GPTNeoForCausalLM"), ("t5", "T5Model"),
                                              ("bloom", "BloomForCausalLM")])
def test_refused_architectures_say_why_and_stay_untouched(model_type, head):
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                            n_layer=2, n_head=4, d_model=32, d_ff=64, d_kv=8,
                                            attention_types=[[["global", "local"], 1]])
    model = getattr(transformers, head)(cfg)
    state, impl = _snapshot(model)
    with pytest.raises(ValueError) as err:
        performer_hf.convert(model)
    message = str(err.value)
    assert repr(model_type) in message and REFUSED[model_type] in message and "Supported: albert, bert" in message
    assert model.config._attn_implementation == impl and not performer_hf.is_converted(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_unknown_architecture_is_refused():
    cfg = transformers.AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=64, image_size=8, patch_size=4)
    with pytest.raises(ValueError, match="'vit' is not supported by performer_hf. Supported: albert"):
        performer_hf.convert(transformers.ViTModel(cfg))


def test_bad_settings_leave_the_model_untouched():
    model = tiny_model("bert")
    state, impl = _snapshot(model)
    with pytest.raises(ValueError, match="PerformerConfig.kernel must be one of favor\\+, hyperbolic"):
        performer_hf.convert(model, kernel="softmax")
    with pytest.raises(ValueError, match="PerformerConfig.num_features must be a positive integer"):
        performer_hf.convert(model, num_features=0)
    with pytest.raises(ValueError, match="unknown PerformerConfig fields \\['features'\\]"):
        performer_hf.convert(model, features=3)
    assert model.config._attn_implementation == impl and not performer_hf.is_converted(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_converting_twice_is_refused_and_changes_nothing():
    model = performer_hf.convert(tiny_model("gpt2"), num_features=16)
    ids, _ = inputs()
    out = logits(model, ids)
    with pytest.raises(ValueError, match="already converted"):
        performer_hf.convert(model, num_features=64)
    assert torch.equal(logits(model, ids), out)


@pytest.mark.parametrize("model_type, limit", [("bert", 128), ("gpt2", 128), ("roberta", 128), ("opt", 128)])
def test_inputs_beyond_the_position_table_are_a_clear_error(model_type, limit):
    model = performer_hf.convert(tiny_model(model_type), num_features=16)
    logits(model, torch.randint(3, 90, (1, limit)))  # the longest input that fits
    with pytest.raises(ValueError, match=f"{limit + 1} tokens exceed the {limit} positions .* max_position_embeddings"):
        logits(model, torch.randint(3, 90, (1, limit + 1)))


def test_loading_an_unconverted_checkpoint_says_so(tmp_path):
    tiny_model("bert").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no Performer settings in its config.json: it is not a converted model"):
        performer_hf.from_pretrained(str(tmp_path))


def test_config_is_forward_compatible():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = PerformerConfig.from_dict({"num_features": 32, "kernel": "favor++", "from_the_future": 1})
    assert config == PerformerConfig(num_features=32, kernel="favor++")
    assert any("from_the_future" in str(w.message) for w in caught)


def test_cross_attention_stays_exact():
    cfg = tiny_config("bert", is_decoder=True, add_cross_attention=True)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    performer_hf.convert(model, num_features=16)
    names = performer_hf.converted_modules(model)
    assert names and all("crossattention" not in n for n in names)
    ids, mask = inputs()
    enc = torch.randn(2, 5, 32)
    enc_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, encoder_hidden_states=enc,
                    encoder_attention_mask=enc_mask).last_hidden_state
    assert torch.isfinite(out).all()


def test_readme_architecture_table_is_generated_from_the_registry():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert markdown_table() in readme, "regenerate it: python -m performer_hf.architectures"


def test_truncated_or_pickled_checkpoints_are_one_line_errors(tmp_path):
    import os

    from performer_hf.cli import main

    model = performer_hf.convert(tiny_model("bert"), num_features=16)
    model.save_pretrained(tmp_path / "conv")
    weights = tmp_path / "conv" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match="safetensors weight file is truncated or corrupt"):
        performer_hf.from_pretrained(str(tmp_path / "conv"))
    source = save_tiny(tmp_path / "pickled")
    os.remove(tmp_path / "pickled" / "model.safetensors")
    torch.save(tiny_model("bert").state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    assert main(["convert", source, "--out", str(tmp_path / "out")]) == 1  # never unpickled, even weights_only
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("corruption, message", [
    (lambda t: t[:1].clone(), "has shape (1, 8) and dtype torch.float32, expected (16, 8)"),
    (lambda t: torch.full_like(t, float("nan")), "holds NaN or infinite values"),
    (lambda t: torch.full_like(t, float("inf")), "holds NaN or infinite values"),
    (lambda t: t.long(), "expected (16, 8) floating point"),
])
def test_corrupt_saved_projections_are_load_errors(tmp_path, corruption, message):
    from safetensors.torch import load_file, save_file

    model = performer_hf.convert(tiny_model("bert"), num_features=16)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "bert.encoder.layer.1.attention.self.performer.projection"
    tensors[key] = corruption(tensors[key])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        performer_hf.from_pretrained(str(tmp_path))
    assert key in str(info.value) and "model.safetensors" in str(info.value)


def test_num_features_is_bounded():
    with pytest.raises(ValueError, match="num_features"):
        performer_hf.PerformerConfig(num_features=10**9)
