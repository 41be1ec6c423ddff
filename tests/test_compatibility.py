"""Every ordinary transformers entry point gives the Performer's own answer or a one-line error (issue 10)."""

import copy
import io

import pytest
import torch
from test_generation import NO_EOS, converted
from tiny_models import LOCAL, PURE, inputs

import performer_hf
from performer_hf.generation import PerformerCache

DECODERS = ["gpt2", "llama", "opt"]


def recomputed(model, ids, new_tokens=8):
    """Greedy tokens recomputing the whole sequence at every step: the Performer's own answer."""
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=False, **NO_EOS)


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
@pytest.mark.parametrize("model_type", DECODERS)
def test_a_deep_copy_generates_its_own_tokens(model_type, local):
    model = converted(model_type, **local)
    ids, _ = inputs(batch=2, length=6)
    clone = copy.deepcopy(model)
    with torch.no_grad():  # make the copy a different model: a copy still wired to the original would not notice
        for p in clone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for m in (clone, model):
        assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False, **NO_EOS), recomputed(m, ids))
    performer_hf.revert(clone)  # the copy's hooks are its own: reverting it leaves the original converted
    assert performer_hf.is_converted(model) and not performer_hf.is_converted(clone)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, **NO_EOS), recomputed(model, ids))


@pytest.mark.parametrize("model_type", ["bert", "llama", "gpt2"])
def test_torch_save_of_the_whole_model_round_trips(model_type):
    model = converted(model_type, **(LOCAL if model_type != "bert" else {}))
    ids, _ = inputs(batch=2, length=10)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # a file the user wrote themselves
    assert performer_hf.is_converted(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    if model_type != "bert":
        assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False, **NO_EOS), recomputed(model, ids, 6))


@pytest.mark.parametrize("implementation", ["static", "offloaded", "sliding_window"])
def test_softmax_cache_implementations_are_refused(implementation):
    model = converted("llama", **LOCAL)
    ids, _ = inputs(batch=1, length=6)
    with pytest.raises(ValueError, match=f"cache_implementation='{implementation}' keeps softmax keys"):
        model.generate(ids, max_new_tokens=4, cache_implementation=implementation, **NO_EOS)


@pytest.mark.parametrize("model_type", ["bert", "llama", "gpt2"])
def test_switching_the_attention_implementation_is_refused(model_type):
    model = converted(model_type)
    ids, _ = inputs(batch=1, length=6)
    with pytest.raises(ValueError, match=r"set_attn_implementation\('eager'\) on a converted model"):
        model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="set_attn_implementation"):
        model.base_model.set_attn_implementation("sdpa")
    model.set_attn_implementation("performer")  # a no-op is fine
    model.config._attn_implementation = "eager"  # the private route: caught at the next forward
    with pytest.raises(ValueError, match="switched to 'eager'"):
        model(ids)
    model.config._attn_implementation = "performer"
    performer_hf.revert(model)
    model.set_attn_implementation("eager")  # after revert the model is the softmax model again
    assert model(ids).logits.isfinite().all()


@pytest.mark.parametrize("model_type", ["bert", "llama", "gpt2"])
def test_output_attentions_is_refused(model_type):
    model = converted(model_type)
    ids, _ = inputs(batch=1, length=6)
    with pytest.raises(ValueError, match="output_attentions=True has nothing to return"):
        model(ids, output_attentions=True)


@pytest.mark.parametrize("model_type", ["bert", "llama", "gpt2"])
def test_loading_a_performer_without_performer_hf_is_refused(model_type, tmp_path):
    import transformers

    model = converted(model_type)
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    plain = auto.from_pretrained(tmp_path, attn_implementation="performer")
    ids, _ = inputs(batch=1, length=6)
    with pytest.raises(ValueError, match=r"load converted checkpoints with performer_hf.from_pretrained"):
        plain(ids)
    reloaded = performer_hf.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("local", [PURE, LOCAL], ids=["pure", "local"])
@pytest.mark.parametrize("model_type", DECODERS)
def test_a_manual_decoding_loop_gets_the_constant_size_state(model_type, local):
    model = converted(model_type, **local)
    ids, _ = inputs(batch=2, length=6)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        assert isinstance(out.past_key_values, PerformerCache)
        tokens, sizes = [out.logits[:, -1].argmax(-1, keepdim=True)], []
        for _ in range(7):
            out = model(tokens[-1], past_key_values=out.past_key_values, use_cache=True)
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            sizes.append(out.past_key_values.nbytes())
    assert torch.equal(torch.cat([ids, *tokens], dim=1), recomputed(model, ids))
    assert len(set(sizes[len(sizes) // 2:])) == 1  # constant once the window is full


def _trainer(model, tmp_path, callbacks):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(3, 90, (8, 12))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
                             save_strategy="no", use_cpu=True, learning_rate=1e-3, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_trainer_redraws_with_the_callback_and_warns_without(tmp_path):
    model = converted("llama", redraw_interval=2)
    before = [m.projection.clone() for m in performer_hf.converted_modules(model).values()]
    _trainer(model, tmp_path, [performer_hf.RedrawCallback(seed=7)]).train()
    after = [m.projection for m in performer_hf.converted_modules(model).values()]
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    again = converted("llama", redraw_interval=2)  # the last redraw (step 4) is a function of the seed and step
    performer_hf.redraw_projections(again, torch.Generator().manual_seed(7 * 1_000_003 + 4))
    for a, b in zip(after, performer_hf.converted_modules(again).values(), strict=True):
        assert torch.equal(a, b.projection)

    model = converted("llama", redraw_interval=2)
    with pytest.warns(UserWarning, match="RedrawCallback"):
        _trainer(model, tmp_path, []).train()


COMPILED = [("bert", {}), ("llama", PURE), ("llama", LOCAL), ("gpt2", LOCAL)]


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("model_type, local", COMPILED, ids=["bert", "llama-pure", "llama-local", "gpt2-local"])
def test_torch_export_gives_the_eager_outputs(model_type, local, masked):
    model = converted(model_type, **local)
    ids, mask = inputs(batch=2, length=12)
    kwargs = {"input_ids": ids, "use_cache": False, **({"attention_mask": mask} if masked else {})}
    with torch.no_grad():  # an inference graph (FAVOR's custom backward is not exportable)
        program = torch.export.export(model, (), kwargs)  # no "packed sequences" error without a mask
        torch.testing.assert_close(program.module()(**kwargs).logits, model(**kwargs).logits)


@pytest.mark.parametrize("model_type, local", COMPILED[1:3], ids=["llama-pure", "llama-local"])
def test_torch_compile_fullgraph_gives_the_eager_outputs(model_type, local):
    torch._dynamo.reset()
    model = converted(model_type, **local)
    ids, mask = inputs(batch=2, length=12)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # the full graph, no C++ build in tests
    with torch.no_grad():
        for kwargs in ({"attention_mask": mask}, {}):
            torch.testing.assert_close(compiled(input_ids=ids, **kwargs).logits, model(input_ids=ids, **kwargs).logits)


def test_packed_sequences_are_refused_only_when_packed():
    model = converted("llama", **LOCAL)
    ids, _ = inputs(batch=1, length=8)
    with torch.no_grad():
        model(ids, position_ids=torch.arange(8)[None], use_cache=False)  # one sequence: fine
        with pytest.raises(ValueError, match="packed sequences via position_ids"):  # transformers only looks
            model(ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), use_cache=False)  # without a cache


def test_pipelines_run_the_performer():
    from tiny_models import tiny_tokenizer
    from transformers import pipeline

    tokenizer = tiny_tokenizer("llama")
    model = converted("llama", **LOCAL)
    text = "linear attention"
    out = pipeline("text-generation", model=model, tokenizer=tokenizer)(text, max_new_tokens=6, do_sample=False,
                                                                         return_full_text=False, **NO_EOS)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(recomputed(model, ids, 6)[0, ids.shape[1]:], skip_special_tokens=True)
    assert out[0]["generated_text"] == expected

    bert = converted("bert")
    features = pipeline("feature-extraction", model=bert.bert, tokenizer=tiny_tokenizer("bert"))(text)
    with torch.no_grad():
        direct = bert.bert(**tiny_tokenizer("bert")(text, return_tensors="pt")).last_hidden_state
    torch.testing.assert_close(torch.tensor(features), direct)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_gradient_checkpointing_gives_the_same_gradients(model_type):
    model = converted(model_type, **(LOCAL if model_type == "llama" else {}))
    ids, mask = inputs(batch=2, length=10)
    grads = []
    for checkpointing in (False, True):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        torch.manual_seed(0)  # the same dropout masks (checkpointing replays the RNG state)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_a_deep_copy_of_an_encoder_is_its_own_model():
    model = converted("bert")
    ids, mask = inputs(batch=2, length=10)
    clone = copy.deepcopy(model)
    performer_hf.revert(clone)
    with torch.no_grad():
        favor, exact = model(ids, attention_mask=mask).logits, clone(ids, attention_mask=mask).logits
        assert not torch.allclose(favor, exact)  # the copy is the softmax model now, the original still FAVOR
        assert torch.equal(favor, copy.deepcopy(model)(ids, attention_mask=mask).logits)
