"""`FinetuneArgs`: the settings of a fine-tune, shared by `finetune()` and `performer-hf finetune`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..corpus import CORPORA


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class FinetuneArgs:
    """Settings of `performer_hf.training.finetune`; each field is also a `performer-hf finetune` flag.

    Example:
        >>> args = FinetuneArgs(out="bert-performer-ft", task="masked-lm", distill=True, max_steps=200)
    """

    out: str = field(metadata=_help("output directory: final model, checkpoints/, metrics.jsonl"))
    stage: str = field(default="end-to-end", metadata=_help(
        "attention: attention transfer, each converted layer learns to reproduce its own softmax output on the same "
        "inputs (only learned feature maps train; convert with --learned-features); end-to-end: the whole model "
        "trains on the task and/or distillation loss", choices=["end-to-end", "attention"]))
    lora_rank: int = field(default=0, metadata=_help(
        "end-to-end stage: train LoRA adapters of this rank (through peft) on the attention and MLP weights instead of "
        "every weight, merged into the model before it is saved (0: train every weight)"))
    lora_alpha: float = field(default=16.0, metadata=_help("LoRA scaling numerator (scale = alpha / rank)"))
    feature_maps_only: bool = field(default=False, metadata=_help(
        "end-to-end stage: train only the learned feature maps (projections, far-context weights) on the end-to-end "
        "loss, every weight of the model frozen: FAVOR learns what the output needs, not only each layer's output"))
    task: str = field(default="auto", metadata=_help(
        "training objective; auto: masked-lm or causal-lm from the model's head, distillation only for base models",
        choices=["auto", "masked-lm", "causal-lm", "distill-only"]))
    # distillation
    distill: bool = field(default=False, metadata=_help("distil from the original softmax model (the teacher)"))
    teacher: str | None = field(default=None, metadata=_help(
        "teacher model (Hub id or directory); default: the base model recorded at conversion"))
    task_weight: float = field(default=1.0, metadata=_help("weight of the task loss (MLM / CLM cross-entropy)"))
    kl_weight: float = field(default=1.0, metadata=_help("weight of KL(teacher || student) on the logits"))
    hidden_weight: float = field(default=1.0, metadata=_help("weight of the MSE between hidden states"))
    embedding_weight: float = field(default=0.0, metadata=_help(
        "weight of 1 - cosine between the mean-pooled last hidden states of student and teacher (the sentence "
        "embedding of sentence-transformers models)"))
    distill_layers: str = field(default="all", metadata=_help("hidden states to match", choices=["all", "last"]))
    temperature: float = field(default=1.0, metadata=_help("softmax temperature of the logit distillation"))
    attention_only_steps: int = field(default=0, metadata=_help(
        "first train only the attention (query/key/value) weights for this many steps, then everything"))
    # data
    dataset: str | None = field(default=None, metadata=_help("Hub dataset name (default: the built-in corpus)"))
    corpus: str = field(default="installed", metadata=_help(
        "built-in corpus when no dataset or file is given: installed (docstrings and descriptions of everything "
        "installed, ~9 MB, cached after a first build of about a minute), stdlib (240 kB, quick) or prose "
        "(everyday-English paragraphs shipped with the package, for models that embed or read plain text)",
        choices=list(CORPORA)))
    dataset_config: str | None = field(default=None, metadata=_help("Hub dataset configuration"))
    train_file: str | None = field(default=None, metadata=_help("local training data: text, json, jsonl, csv, "
                                                                 "parquet"))
    validation_file: str | None = field(default=None, metadata=_help("local validation data"))
    text_column: str = field(default="text", metadata=_help("column holding the text"))
    validation_percent: int = field(default=5, metadata=_help("held out from train when no validation data"))
    max_length: int = field(default=128, metadata=_help("tokens per packed training block"))
    packing: str = field(default="auto", metadata=_help(
        "how texts become training blocks; concatenate: all texts joined and cut into blocks of --max-length (causal "
        "LMs); document: each block a piece of one document in the tokenizer's special tokens, short pieces padded "
        "(what an encoder sees when it embeds a text); auto: document for bidirectional models, concatenate for "
        "causal ones", choices=["auto", "concatenate", "document"]))
    max_train_samples: int | None = field(default=None, metadata=_help("cap on training blocks (quick runs)"))
    max_eval_samples: int | None = field(default=32, metadata=_help(
        "cap on validation blocks (so the end-of-run evaluation takes seconds)"))
    mlm_probability: float = field(default=0.15, metadata=_help("masking rate for masked-lm"))
    # optimisation
    max_steps: int | None = field(default=None, metadata=_help("optimizer steps (overrides --num-epochs)"))
    num_epochs: float = field(default=1.0, metadata=_help("passes over the training data"))
    batch_size: int = field(default=8, metadata=_help("blocks per device per step"))
    gradient_accumulation_steps: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    learning_rate: float = field(default=5e-5, metadata=_help("peak AdamW learning rate"))
    weight_decay: float = field(default=0.01, metadata=_help("AdamW weight decay"))
    warmup_ratio: float = field(default=0.06, metadata=_help("fraction of steps of linear warm-up"))
    lr_scheduler: str = field(default="linear", metadata=_help("decay after warm-up",
                                                               choices=["linear", "cosine", "constant"]))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm (0: off)"))
    mixed_precision: str = field(default="no", metadata=_help("through accelerate", choices=["no", "bf16", "fp16"]))
    seed: int = field(default=42, metadata=_help("seed of data order, masking and redraws"))
    redraw_interval: int | None = field(default=None, metadata=_help(
        "redraw the projections every N steps (default: the model's redraw_interval; 0: never)"))
    # bookkeeping
    logging_steps: int = field(default=10, metadata=_help("log metrics every N steps"))
    eval_steps: int | None = field(default=None, metadata=_help("evaluate every N steps (always at the end)"))
    save_steps: int | None = field(default=None, metadata=_help("save a resumable checkpoint every N steps "
                                                                "(always at the end)"))
    resume: bool = field(default=False, metadata=_help("continue from the newest complete checkpoint in --out"))
    report_to: str | None = field(default=None, metadata=_help("accelerate tracker, e.g. tensorboard or wandb"))
    push_to_hub: str | None = field(default=None, metadata=_help("upload the final model to this Hub repository"))
    private: bool = field(default=False, metadata=_help("with --push-to-hub: create a private repository"))
    progress: bool = field(default=True, metadata=_help("show a progress bar on the main process"))

    def __post_init__(self):
        for name in ("batch_size", "gradient_accumulation_steps", "max_length", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"FinetuneArgs.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_steps", "save_steps", "eval_steps", "max_train_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"FinetuneArgs.{name} must be at least 1, got {value}")
        positive = {"learning_rate": self.learning_rate, "num_epochs": self.num_epochs, "temperature": self.temperature}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"FinetuneArgs.{name} must be positive, got {value}")
        for name in ("weight_decay", "max_grad_norm", "task_weight", "kl_weight", "hidden_weight", "embedding_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"FinetuneArgs.{name} must be 0 or more, got {getattr(self, name)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"FinetuneArgs.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_eval_samples is not None and self.max_eval_samples < 1:
            raise ValueError(f"FinetuneArgs.max_eval_samples must be at least 1, got {self.max_eval_samples}")
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"--out {self.out} is a file; pass a directory")
        if not 0 < self.mlm_probability < 1:
            raise ValueError(f"FinetuneArgs.mlm_probability must be in (0, 1), got {self.mlm_probability}")
        if self.corpus not in CORPORA:
            raise ValueError(f"--corpus must be one of {', '.join(CORPORA)}, got {self.corpus!r}")
        if self.dataset and self.train_file:
            raise ValueError("give either --dataset or --train-file, not both")
        if self.teacher and not self.distill:
            raise ValueError("--teacher only makes sense with --distill")
        if self.stage == "attention" and (self.distill or self.lora_rank):
            raise ValueError("--stage attention needs no teacher and trains no LoRA: each layer's target is its own "
                             "softmax output; drop --distill / --lora-rank")
        if self.feature_maps_only and (self.stage == "attention" or self.lora_rank):
            raise ValueError("--feature-maps-only is an end-to-end option that trains nothing but the feature maps; "
                             "drop --stage attention / --lora-rank")
        if self.lora_rank < 0:
            raise ValueError(f"FinetuneArgs.lora_rank must be 0 (off) or positive, got {self.lora_rank}")
