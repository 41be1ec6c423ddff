"""`performer-hf convert MODEL --out DIR`: load, convert, report fidelity, save (and optionally push)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

NAME = "convert"
HELP = "convert a Hub checkpoint or local model directory to a Performer and report its fidelity"
POSITIONAL = (("model", "a Hub id (e.g. bert-base-uncased) or a local model directory"),)


@dataclass
class Args:
    out: str = field(metadata={"help": "output directory (written atomically)"})
    task: str = field(default="auto", metadata={"help": "which head to load; auto reads config.architectures",
                                                 "choices": ["auto", "base", "masked-lm", "causal-lm",
                                                             "sequence-classification"]})
    num_features: int = field(default=256, metadata={"help": "random features per layer"})
    kernel: str = field(default="favor+", metadata={"help": "feature map",
                                                    "choices": ["favor+", "hyperbolic", "favor++", "hedgehog", "trig",
                                                                "relu"]})
    projection: str = field(default="orthogonal", metadata={"help": "random projection",
                                                            "choices": ["orthogonal", "gaussian", "structured"]})
    seed: int = field(default=0, metadata={"help": "seed of the projections"})
    sink_tokens: int | None = field(default=None, metadata={"help": "exact attention to the first S real tokens "
                                                                     "(default: 4 for causal models, 0 otherwise)"})
    local_window: int | None = field(default=None, metadata={"help": "exact attention to the W most recent keys, "
                                                                     "FAVOR for the rest (default: 128 for causal "
                                                                     "models, 0 otherwise; 0 = pure FAVOR)"})
    learned_features: bool = field(default=False, metadata={"help": "trainable projections (for attention "
                                                                    "transfer: performer-hf finetune --stage "
                                                                    "attention)"})
    per_head_features: bool = field(default=False, metadata={"help": "one projection per head"})
    feature_bias: bool = field(default=False, metadata={"help": "hedgehog: learned query and key feature biases"})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside MODEL's directory (or pass "
                                                                  "the .gguf path as MODEL); needs `pip install "
                                                                  "gguf`"})
    max_length: int | None = field(default=None, metadata={"help": "longest input in tokens: a learned position "
                                                                   "table shorter than this is extended (fine-tune "
                                                                   "at the new length); sets the tokenizer's limit"})
    eval_file: str | None = field(default=None, metadata={"help": "text file, one sentence per line, for the "
                                                                  "fidelity report (default: built-in sentences)"})
    overwrite: bool = field(default=False, metadata={"help": "replace a non-empty --out"})
    push_to_hub: str | None = field(default=None, metadata={"help": "also upload to this Hub repository"})
    private: bool = field(default=False, metadata={"help": "with --push-to-hub: create a private repository"})


def run(args: Args, model: str) -> int:
    from .. import fidelity
    from ..architectures import lookup, position_limit
    from ..config import PerformerConfig
    from ..conversion import convert, performer_settings
    from ..hub import atomic_output_dir, check_output_dir, load_pretrained, model_card, push_directory, split_gguf
    from ..sentence import copy_files, sentence_transformer_files
    from . import UsageError

    out = Path(args.out)
    try:
        check_output_dir(out, args.overwrite)
        settings = PerformerConfig(num_features=args.num_features, kernel=args.kernel, projection=args.projection,
                                   seed=args.seed, sink_tokens=args.sink_tokens, local_window=args.local_window,
                                   learned_features=args.learned_features,
                                   per_head_features=args.per_head_features, feature_bias=args.feature_bias)
    except (FileExistsError, ValueError) as err:
        raise UsageError(str(err)) from err
    texts = fidelity.builtin_sentences()
    if args.eval_file:
        path = Path(args.eval_file)
        if not path.is_file():
            raise UsageError(f"--eval-file {path}: no such file")
        texts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            raise UsageError(f"--eval-file {path} has no non-empty lines")

    if args.max_length is not None and args.max_length < 1:
        raise UsageError(f"--max-length must be positive, got {args.max_length}")
    loaded, tokenizer, task = load_pretrained(model, args.task, gguf_file=args.gguf_file)
    model, gguf_file = split_gguf(model, args.gguf_file)
    try:  # checked before converting: a sentence-transformers model naming custom code or pickles is refused
        st_files = sentence_transformer_files(model)
    except ValueError as err:
        raise UsageError(str(err)) from err
    limit = position_limit(lookup(loaded.config.model_type), loaded.config)
    extend_to = args.max_length if args.max_length is not None and (limit is None or args.max_length > limit) else None
    if args.max_length is not None:
        tokenizer.model_max_length = args.max_length
    eval_length = min(x for x in (args.max_length, limit, 128) if x is not None)
    if tokenizer.pad_token is None:  # GPT-style tokenizers: pad with EOS for the batched fidelity pass
        tokenizer.pad_token = tokenizer.eos_token
    if task == "causal-lm":  # long sequences, where the exact window no longer covers everything
        batch = fidelity.joined(tokenizer, texts, length=min(x for x in (args.max_length, limit, 512) if x))
    else:
        batch = fidelity.encode(tokenizer, texts, max_length=eval_length)
    reference = fidelity.outputs(loaded, batch)
    calibration = None
    if settings.kernel == "favor++":
        calibration = fidelity.calibration_batch(tokenizer, max_length=eval_length)
    convert(loaded, settings, max_position_embeddings=extend_to, calibration=calibration)
    settings = performer_settings(loaded.config)  # with the defaults for this model filled in
    # a local directory is recorded as an absolute path, so finetune --distill finds the teacher from anywhere
    loaded.config.performer["base_model"] = str(Path(model).resolve()) if Path(model).exists() else model
    if gguf_file is not None:
        loaded.config.performer["base_model_gguf_file"] = gguf_file
    is_lm = task in ("masked-lm", "causal-lm")
    metrics = fidelity.compare(reference, fidelity.outputs(loaded, batch), batch["attention_mask"], is_lm=is_lm)
    columns = {"converted": metrics}
    if settings.is_local:  # what the exact sinks and window are worth, on the same tokens
        with fidelity.pure_favor(loaded):
            columns["pure FAVOR, for comparison"] = fidelity.compare(
                reference, fidelity.outputs(loaded, batch), batch["attention_mask"], is_lm=is_lm)
    report = fidelity.format_report(columns)
    metrics = {"tokens": int(batch["attention_mask"].sum()), **metrics}
    if len(columns) > 1:
        metrics["pure_favor"] = columns["pure FAVOR, for comparison"]

    with atomic_output_dir(out, overwrite=args.overwrite) as tmp:
        loaded.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        carried = copy_files(st_files, tmp)  # a sentence-transformers model stays one
        (tmp / "fidelity.json").write_text(json.dumps({"texts": len(texts), **metrics}, indent=1) + "\n")
        card = model_card(base_model=model, task=task, settings=settings, report=report,
                          model_type=loaded.config.model_type, location=args.push_to_hub or str(out))
        (tmp / "README.md").write_text(card)
    n = len(loaded.config.performer["converted_modules"])
    print(f"converted {n} attention layers of {model} ({loaded.config.model_type}, {task}) -> {out}")
    if extend_to is not None and limit is not None:
        print(f"position table extended from {limit} to {extend_to} tokens by repeating it: fine-tune at the new "
              "length")
    if carried:
        print(f"kept it a sentence-transformers model ({', '.join(carried)}): load it with "
              f"performer_hf.load_sentence_transformer({str(out)!r})")
    print(report)
    print("A converted model needs a short fine-tune to recover its accuracy: performer-hf finetune "
          f"{out} --out {out}-finetuned --distill")
    if args.push_to_hub:
        url = push_directory(out, args.push_to_hub, private=args.private,
                             commit_message=f"Performer conversion of {model}")
        print(f"pushed {out} to {args.push_to_hub}: {url}")
    return 0
