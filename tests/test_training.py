"""The fine-tune loop on tiny models: losses fall, distillation closes the gap, kill-and-resume is exact."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny, tiny_model, tiny_tokenizer

import performer_hf
from performer_hf import fidelity
from performer_hf.cli import main
from performer_hf.training import FinetuneArgs, TrainingDiverged, builtin_corpus, finetune
from performer_hf.training.data import load_texts

QUICK = dict(corpus="stdlib", max_length=32, batch_size=8, learning_rate=1e-3, logging_steps=1, progress=False,
             max_eval_samples=16)


def converted_dir(tmp_path, model_type="bert", head=None, name="conv", init_range=None, **settings):
    extra = {} if init_range is None else {"initializer_range": init_range}
    src = save_tiny(tmp_path / f"src-{model_type}", model_type, head=head, **extra)
    model = performer_hf.convert(_load(src), **{"num_features": 16, **settings})
    model.save_pretrained(tmp_path / name)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def _load(src):
    import transformers

    config = transformers.AutoConfig.from_pretrained(src)
    return getattr(transformers, config.architectures[0]).from_pretrained(src)


def losses(out):
    return [row["loss"] for row in map(json.loads, Path(out, "metrics.jsonl").read_text().splitlines())
            if "loss" in row]


@pytest.mark.parametrize("model_type, task", [("bert", "masked-lm"), ("gpt2", "causal-lm")])
def test_language_model_loss_falls(tmp_path, model_type, task):
    model_dir = converted_dir(tmp_path, model_type)
    result = finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), max_steps=40, **QUICK))
    seen = losses(tmp_path / "ft")
    assert len(seen) == 40
    first, last = sum(seen[:5]) / 5, sum(seen[-5:]) / 5
    assert last < 0.9 * first, (first, last)  # character-level LM: from about ln(74) = 4.3 nats
    assert result["eval_loss"] < first
    if task == "masked-lm":
        assert 0 <= result["eval_masked_accuracy"] <= 1
    again = performer_hf.from_pretrained(str(tmp_path / "ft"))
    assert performer_hf.is_converted(again)


def peaked_encoder_and_fidelity(tmp_path):
    """A converted tiny BertModel with peaked attention (larger weights than the default init, as in pretrained
    models) and a function giving a saved student's fidelity figures to its teacher on held-out sentences."""
    model_dir = converted_dir(tmp_path, "bert", head="BertModel", num_features=8, init_range=0.25)
    teacher = _load(str(tmp_path / "src-bert")).eval()
    from transformers import AutoTokenizer

    batch = fidelity.encode(AutoTokenizer.from_pretrained(model_dir), fidelity.builtin_sentences())
    reference = fidelity.outputs(teacher, batch)

    def figures(path):
        student = performer_hf.from_pretrained(path).eval()
        return fidelity.compare(reference, fidelity.outputs(student, batch), batch["attention_mask"], is_lm=False)

    return model_dir, figures


def test_distillation_brings_a_base_model_back_to_its_teacher(tmp_path):
    model_dir, figures = peaked_encoder_and_fidelity(tmp_path)
    before = figures(model_dir)["token_cosine"]
    result = finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), distill=True, max_steps=30, **QUICK))
    after = figures(str(tmp_path / "ft"))["token_cosine"]
    assert after > before + 0.02, (before, after)  # measured on held-out sentences, not the training corpus
    assert result["eval_hidden_cosine_to_teacher"] > 0.9
    seen = losses(tmp_path / "ft")
    assert sum(seen[-5:]) < sum(seen[:5])


def test_embedding_loss_alone_brings_sentence_embeddings_back(tmp_path):
    """`embedding_weight` alone (no hidden-state term): 1 - cosine of the mean-pooled embeddings is logged and falls,
    and the held-out sentence-embedding cosine rises."""
    model_dir, figures = peaked_encoder_and_fidelity(tmp_path)
    finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), distill=True, hidden_weight=0.0, embedding_weight=1.0,
                                     max_steps=30, **QUICK))
    rows = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    terms = [r["embedding_loss"] for r in rows if "loss" in r]
    assert "hidden_loss" not in rows[0] and sum(terms[-5:]) < 0.8 * sum(terms[:5]), terms
    before, after = (figures(path)["embedding_cosine"] for path in (model_dir, str(tmp_path / "ft")))
    assert after > before + 0.02, (before, after)  # measured 0.914 -> 0.953


def test_logit_distillation_for_an_lm_head(tmp_path):
    model_dir = converted_dir(tmp_path, "gpt2")
    finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), distill=True, task_weight=0.0, max_steps=20, **QUICK))
    seen = losses(tmp_path / "ft")
    assert sum(seen[-5:]) < 0.9 * sum(seen[:5])


class Killed(Exception):
    pass


def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path):
    model_dir = converted_dir(tmp_path, "bert", redraw_interval=4)
    common = dict(max_steps=10, save_steps=3, seed=7, **QUICK)
    finetune(model_dir, FinetuneArgs(out=str(tmp_path / "straight"), **common))

    def kill_at_7(step, logs):
        if step == 7:
            raise Killed

    with pytest.raises(Killed):
        finetune(model_dir, FinetuneArgs(out=str(tmp_path / "resumed"), **common), callbacks=[kill_at_7])
    checkpoints = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_3", "step_6"]
    # a checkpoint cut off mid-write never has its final name, and an incomplete one is skipped
    (checkpoints / ".step_9.partial").mkdir()
    (checkpoints / "step_99").mkdir()
    finetune(model_dir, FinetuneArgs(out=str(tmp_path / "resumed"), resume=True, **common))
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == list(range(1, 11))  # step 7 was logged before the kill: cut back, logged once
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    original = load_file(Path(model_dir) / "model.safetensors")
    projection = "bert.encoder.layer.0.attention.self.performer.projection"
    assert not torch.equal(a[projection], original[projection])  # redrawn at steps 4 and 8


def test_attention_only_phase_trains_only_attention(tmp_path):
    model_dir = converted_dir(tmp_path, "bert")
    finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), attention_only_steps=3, max_steps=3, **QUICK))
    before = load_file(Path(model_dir) / "model.safetensors")
    after = load_file(tmp_path / "ft" / "model.safetensors")
    for frozen in ("bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.output.dense.weight"):
        assert torch.equal(before[frozen], after[frozen])
    assert not torch.equal(before["bert.encoder.layer.0.attention.self.query.weight"],
                           after["bert.encoder.layer.0.attention.self.query.weight"])


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    model_dir = converted_dir(tmp_path, "bert")
    args = FinetuneArgs(out=str(tmp_path / "ft"), max_steps=6, save_steps=2, **QUICK)
    model = performer_hf.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def break_weights(step, logs):
        if step == 2:
            with torch.no_grad():
                model.bert.embeddings.word_embeddings.weight.fill_(float("nan"))

    with pytest.raises(TrainingDiverged, match="loss became nan at step 3; training stopped and the last good "
                                               "checkpoint is .*step_2"):
        finetune(model, args, tokenizer=tokenizer, callbacks=[break_weights])
    assert (tmp_path / "ft" / "checkpoints" / "step_2" / "loop_state.json").is_file()


def test_bad_inputs_get_their_messages(tmp_path, capsys):
    model_dir = converted_dir(tmp_path, "bert")
    plain = save_tiny(tmp_path / "plain", "bert")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = [
        (["finetune", plain, "--out", str(tmp_path / "a")], "is not a converted model; convert it first: "
                                                            "performer-hf convert"),
        (["finetune", model_dir, "--out", str(tmp_path / "b"), "--train-file", str(empty)], "is empty"),
        (["finetune", model_dir, "--out", str(tmp_path / "c"), "--train-file", str(tmp_path / "missing.txt")],
         "no such file"),
        (["finetune", model_dir, "--out", str(tmp_path / "d"), "--max-length", "4096"],
         "--max-length 4096 exceeds the 128 positions"),
        (["finetune", str(tmp_path / "src-bert"), "--out", str(tmp_path / "f")], "is not a converted model"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    base_dir = converted_dir(tmp_path, "bert", head="BertModel", name="base")
    assert main(["finetune", base_dir, "--out", str(tmp_path / "g")]) == 1
    assert "has no language-model head: train it with --distill" in capsys.readouterr().err


def test_local_files_of_each_format(tmp_path):
    texts = [f"sentence number {i} about the weather and the sea" for i in range(40)]
    (tmp_path / "train.txt").write_text("\n".join(texts))
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    (tmp_path / "train.csv").write_text("text\n" + "\n".join(texts))
    for name in ("train.txt", "train.jsonl", "train.csv"):
        raw = load_texts(FinetuneArgs(out="x", train_file=str(tmp_path / name), validation_percent=10))
        assert len(raw["train"]) == 36 and len(raw["validation"]) == 4
    with pytest.raises(ValueError, match="no column 'body'"):
        load_texts(FinetuneArgs(out="x", train_file=str(tmp_path / "train.csv"), text_column="body"))


def test_builtin_corpus_is_english_prose_and_stable():
    corpus = builtin_corpus()
    assert len(corpus) > 1000 and corpus == builtin_corpus()
    assert all(len(p.split()) >= 8 and ">>>" not in p for p in corpus)


def test_prose_corpus_is_shipped_everyday_english_split_by_document():
    from performer_hf.corpus import PROSE_FILE, corpus_fingerprint, corpus_split

    train, valid = corpus_split("prose", 5)
    assert len(train) > 1500 and 0.02 < len(valid) / (len(train) + len(valid)) < 0.08
    assert not set(train) & set(valid) and (train, valid) == corpus_split("prose", 5)
    words = [w.strip(".,!?;:'\"").lower() for p in train for w in p.split()]
    common = sum(w in {"the", "a", "and", "of", "to", "in", "is", "it"} for w in words) / len(words)
    assert common > 0.15 and all(len(p.split()) >= 12 for p in train)  # sentences, not code or word lists
    assert not any(marker in p for p in train for marker in ("def ", ">>>", "import ", "<|"))
    assert len(corpus_fingerprint("prose")) == 12 and PROSE_FILE.stat().st_size < 2_000_000
    with pytest.raises(ValueError, match="corpus"):
        FinetuneArgs(out="x", corpus="poetry")


def test_demo_reruns_into_its_own_output_and_refuses_anything_else(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("minilm_demo", Path(__file__).parents[1] / "finetune" /
                                                  "minilm_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = tmp_path / "demo"
    demo.claim_output(out)
    (out / "transfer").mkdir()
    (out / "transfer" / "metrics.jsonl").write_text("{}\n")  # a first run, perhaps interrupted
    demo.claim_output(out)  # `make demo` twice: the second run starts clean
    assert [p.name for p in out.iterdir()] == [demo.DEMO_MARK]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="not written by this demo"):
        demo.claim_output(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_accelerate_launch_two_processes(tmp_path):
    model_dir = converted_dir(tmp_path, "gpt2")
    launcher = Path(sys.executable).parent / "accelerate"
    cmd = [str(launcher), "launch", "--num_processes", "2", "--cpu", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "performer_hf.cli", "finetune", model_dir, "--out", str(tmp_path / "ddp"),
           "--max-steps", "4", "--max-length", "32", "--batch-size", "4", "--redraw-interval", "2",
           "--logging-steps", "1", "--save-steps", "2", "--progress", "false", "--corpus", "stdlib"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(tmp_path / "ddp")) == 4  # one line per step, from the main process only
    assert performer_hf.is_converted(performer_hf.from_pretrained(str(tmp_path / "ddp")))


def test_the_final_model_can_be_pushed(tmp_path, monkeypatch):
    from fake_hub import FakeHub
    from huggingface_hub import constants

    model_dir = converted_dir(tmp_path, "gpt2")
    with FakeHub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", hub.token)
        finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), max_steps=2, save_steps=1, push_to_hub="me/ft",
                                         **QUICK))
    files = hub.repos["me/ft"]["files"]
    assert {"model.safetensors", "config.json", "README.md"} <= set(files)
    assert "metrics.jsonl" not in files  # a model repository holds the model, not the run's logs
    assert not any(name.startswith("checkpoints/") for name in files)  # resumable state stays local
    assert b"Fine-tuned for 2 steps after conversion" in files["README.md"]


def test_bf16_mixed_precision_through_accelerate(tmp_path):
    model_dir = converted_dir(tmp_path, "gpt2")
    result = finetune(model_dir, FinetuneArgs(out=str(tmp_path / "ft"), max_steps=6, mixed_precision="bf16",
                                              **QUICK))
    seen = losses(tmp_path / "ft")
    assert len(seen) == 6 and all(map(math.isfinite, seen)) and math.isfinite(result["eval_loss"])


def test_resume_without_a_complete_checkpoint_starts_again(tmp_path, capsys):
    model_dir = converted_dir(tmp_path, "bert")
    out = tmp_path / "killed-early"
    (out / "checkpoints" / ".step_2.partial").mkdir(parents=True)  # killed while writing its first checkpoint
    (out / ".final.partial").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    assert main(["finetune", model_dir, "--out", str(out), "--resume", "--max-steps", "2", "--max-length", "32",
                 "--batch-size", "2", "--max-eval-samples", "2", "--corpus", "stdlib"]) == 0
    assert "starting from the beginning" in capsys.readouterr().out
    assert not (out / "checkpoints" / ".step_2.partial").exists() and not (out / ".final.partial").exists()
    assert (out / "model.safetensors").is_file()


def test_resume_says_when_it_cannot_be_exact_and_refuses_corrupt_checkpoints(tmp_path, capsys):
    model_dir = converted_dir(tmp_path, "bert")
    common = dict(max_steps=4, save_steps=1, seed=7, **QUICK)
    out = tmp_path / "run"
    finetune(model_dir, FinetuneArgs(out=str(out), **common))
    capsys.readouterr()
    finetune(model_dir, FinetuneArgs(out=str(out), resume=True, **{**common, "max_steps": 5}))
    assert "not an exact resume" not in capsys.readouterr().out  # a sound checkpoint resumes exactly
    (out / "checkpoints" / "step_5" / "random_states_0.pkl").write_bytes(b"not a pickle")
    finetune(model_dir, FinetuneArgs(out=str(out), resume=True, **{**common, "max_steps": 6}))
    assert "not an exact resume" in capsys.readouterr().out
    weights = out / "checkpoints" / "step_6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    assert main(["finetune", model_dir, "--out", str(out), "--resume", "--max-steps", "7", "--corpus", "stdlib",
                 "--max-length", "32", "--batch-size", "2", "--max-eval-samples", "2"]) == 1
    last = capsys.readouterr().err.rstrip().splitlines()[-1]  # (after the loading progress bars)
    assert last.startswith("performer-hf finetune: error: --resume:") and "cannot be loaded" in last
    assert "step_6" in last


def test_bad_training_data_is_one_line_naming_the_file(tmp_path, capsys):
    model_dir = converted_dir(tmp_path, "bert")
    good = "\n".join(f"line number {i} of ordinary text" for i in range(50))
    files = {
        "binary.txt": (b"some text\x00\x01\x02" * 100, "is binary"),
        "latin1.txt": ("caf\u00e9 au lait\n".encode("latin-1") * 50, "is not UTF-8"),
        "cut.jsonl": ((json.dumps({"text": "fine"}) + "\n") * 5 + '{"text": "cut sho', "line 6: not valid JSON"),
        "numbers.jsonl": ((json.dumps({"text": "fine"}) + "\n") * 3 + json.dumps({"text": 42}) + "\n",
                          "line 4: 'text' is a int, not text"),
        "numbers.csv": ("text\n" + "\n".join(str(i) for i in range(50)), "holds int64, not text"),
        "one-line.txt": ("word " * 200_000, "too few to hold out"),
    }
    capsys.readouterr()
    for name, (content, message) in files.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        assert main(["finetune", model_dir, "--out", str(tmp_path / f"out-{name}"), "--train-file", str(path)]) == 1
        last = capsys.readouterr().err.rstrip().splitlines()[-1]  # (after any loading progress bars)
        assert last.startswith("performer-hf finetune: error:") and message in last and str(path) in last, name
    (tmp_path / "good.txt").write_text(good)  # the checks pass ordinary text
    assert len(load_texts(FinetuneArgs(out="x", train_file=str(tmp_path / "good.txt")))["train"]) > 40


def test_offline_dataset_message_fits_the_case(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(OSError) as info:
        load_texts(FinetuneArgs(out="x", dataset="nobody/no-such-dataset"))
    assert "offline mode (HF_HUB_OFFLINE=1) is on" in str(info.value) and "set HF_HUB_OFFLINE=1" not in str(info.value)


def test_encoders_train_on_pieces_of_single_documents(tmp_path):
    """`packing="document"` (the default for bidirectional models): every block is [CLS] + a piece of one document
    + [SEP], the pieces of a document in order and complete; causal models keep the concatenated blocks."""
    from datasets import Dataset, DatasetDict

    from performer_hf.training.data import pack
    from performer_hf.training.loop import _by_document

    tokenizer = tiny_tokenizer("bert")
    docs = ["the quick brown fox jumps over the lazy dog " * 4, "a short line", "  "]
    raw = DatasetDict(train=Dataset.from_dict({"text": docs}), validation=Dataset.from_dict({"text": ["x"]}))
    blocks = pack(raw, tokenizer, 16, "text", by_document=True)["train"]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    ids = [b["input_ids"] for b in blocks]
    assert all(b[0] == cls and b[-1] == sep and len(b) <= 16 for b in ids)
    assert [b["special_tokens_mask"] for b in blocks][0] == [1] + [0] * 14 + [1]
    text_ids = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs[:2]]
    assert sum((b[1:-1] for b in ids[:-1]), []) == text_ids[0] and ids[-1][1:-1] == text_ids[1]
    assert len(ids[-1]) < 16  # a document's last piece is short (padded by the collator), never joined to the next
    with pytest.raises(ValueError, match="no room for text"):
        pack(raw, tokenizer, 2, "text", by_document=True)
    assert _by_document(performer_hf.convert(tiny_model("bert")), "auto")
    assert not _by_document(performer_hf.convert(tiny_model("gpt2")), "auto")
    assert _by_document(performer_hf.convert(tiny_model("gpt2")), "document")

