"""The fine-tune loop: accelerate's canonical skeleton (as in transformers' run_mlm_no_trainer), driven by a
`FinetuneArgs` object so tests and the CLI call the same function.

Runs unchanged under `accelerate launch` on one CPU, one or several GPUs, or several machines (DDP, FSDP, DeepSpeed
through accelerate's own config). Checkpoints are accelerate `save_state` directories (model, optimizer, scheduler,
RNG) plus the loop's position, renamed into place only when complete, so a run killed at any moment resumes from
the newest complete one and replays exactly what an uninterrupted run would have done.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import torch

from ..architectures import lookup, position_limit
from ..conversion import (
    converted_modules,
    from_pretrained,
    is_converted,
    mark_redraws_applied,
    performer_settings,
    redraw_projections,
)
from ..hub import NO_REMOTE_CODE, task_of_architecture
from .args import FinetuneArgs
from .context import (
    CHECKPOINTS,
    TrainingDiverged,
    clean_partial_checkpoints,
    complete_checkpoints,
    cut_metrics,
    rng_state_readable,
)
from .data import SeededCollator, load_texts, pack, with_index
from .end_to_end import EndToEnd, with_lora
from .transfer import AttentionTransfer, train_only_feature_maps

__all__ = ["TrainingDiverged", "finetune"]


def _task_of(model, requested: str) -> str:
    if requested != "auto":
        return requested
    task = task_of_architecture(type(model).__name__)
    return task if task in ("masked-lm", "causal-lm") else "distill-only"


def _by_document(model, packing: str) -> bool:
    """Whether training blocks are pieces of single documents (`FinetuneArgs.packing`): by default for models whose
    attention is bidirectional (encoders embed one text at a time, [CLS] first)."""
    if packing != "auto":
        return packing == "document"
    return not any(getattr(model.get_submodule(name), "is_causal", False) for name in converted_modules(model))


def _load_student(model_or_path, tokenizer):
    from transformers import AutoTokenizer

    if isinstance(model_or_path, str | Path):
        path = str(model_or_path)
        if not Path(path).exists() and path.startswith((".", "/")):
            raise FileNotFoundError(f"{path}: no such model directory")
        from transformers import AutoConfig

        if performer_settings(AutoConfig.from_pretrained(path, **NO_REMOTE_CODE)) is None:
            raise ValueError(f"{path} is not a converted model; convert it first: performer-hf convert {path} "
                             f"--out {path.rstrip('/')}-performer (or performer_hf.convert(model) in Python)")
        model = from_pretrained(path)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path, **NO_REMOTE_CODE)
    else:
        model = model_or_path
        if not is_converted(model):
            raise ValueError("the model is not converted; call performer_hf.convert(model) first")
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path, **NO_REMOTE_CODE)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _load_teacher(student, args: FinetuneArgs):
    from ..hub import LoadError, dequantized, load_error_message, split_gguf

    meta = student.config.performer or {}
    source = args.teacher or meta.get("base_model")
    if not source:
        raise ValueError("no teacher: this model does not record the model it was converted from; pass --teacher")
    source, gguf_file = split_gguf(source, None if args.teacher else meta.get("base_model_gguf_file"))
    try:
        teacher = type(student).from_pretrained(
            source, **({"gguf_file": gguf_file} if gguf_file else {"use_safetensors": True}), **NO_REMOTE_CODE)
    except Exception as err:  # load_error_message re-raises what is not a loading problem
        raise LoadError(f"teacher: {load_error_message(source, err)}") from err
    if gguf_file:
        teacher = dequantized(teacher)
    if is_converted(teacher):
        raise ValueError(f"teacher {source} is itself a converted model; distil from the original softmax model")
    return teacher.eval().requires_grad_(False)


def _forget_previous_precision(mixed_precision: str) -> None:
    """accelerate keeps its state per process; a second `finetune()` in the same process (a notebook) with another
    precision would be refused. Only the accelerator-level state is dropped; the process group is kept."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if shared and str(shared.get("_mixed_precision", mixed_precision)) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def _param_groups(model, weight_decay: float, attention_only: bool):
    """AdamW groups: no decay for biases and norms; with `attention_only`, the attention weights apart."""
    attention = {id(p) for name in converted_modules(model) for p in model.get_submodule(name).parameters()}
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # learned FAVOR projections: decay would pull every feature towards a constant (uniform attention)
        decay = param.dim() >= 2 and "norm" not in name.lower() and "performer." not in name
        key = ("attention" if attention_only and id(param) in attention else "rest", decay)
        groups.setdefault(key, []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0, "name": f"{part}-{decay}"}
            for (part, decay), params in sorted(groups.items())]


def finetune(model_or_path, args: FinetuneArgs, *, tokenizer=None, callbacks=()) -> dict:
    """Fine-tune a converted model to recover the accuracy of its original.

    Args:
        model_or_path (`PreTrainedModel` or `str`): a converted model, or the directory/Hub id of a saved one.
        args (`FinetuneArgs`): the settings (the same dataclass feeds `performer-hf finetune`).
        tokenizer (*optional*): defaults to the one saved with the model.
        callbacks (*optional*): callables `(step, logs)` run after every optimizer step on every process.

    Returns:
        `dict` with the final evaluation metrics and where the model was written.

    Example:
        >>> args = FinetuneArgs(out="bert-performer-ft", distill=True, max_steps=100)
        >>> finetune("bert-performer", args)  # doctest: +SKIP
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import DataCollatorForLanguageModeling, get_scheduler

    out = Path(args.out)
    clean_partial_checkpoints(out)  # what a run killed while writing left behind
    if args.resume and not complete_checkpoints(out):
        print(f"--resume: no complete checkpoint under {out / CHECKPOINTS}; starting from the beginning", flush=True)
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
        args = dataclasses.replace(args, resume=False)
    if not args.resume and out.exists() and any(p.name != ".gitkeep" for p in out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; pass --resume to continue a run, or choose another "
                              "--out")
    _forget_previous_precision(args.mixed_precision)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=args.report_to,
        project_dir=str(out),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(args.seed)
    model, tokenizer = _load_student(model_or_path, tokenizer)
    task = _task_of(model, args.task)
    if task == "distill-only" and not args.distill and args.stage != "attention":
        raise ValueError(f"{type(model).__name__} has no language-model head: train it with --distill "
                         "(hidden-state matching to the original)")
    limit = position_limit(lookup(model.config.model_type), model.config)
    if limit is not None and args.max_length > limit:
        raise ValueError(f"--max-length {args.max_length} exceeds the {limit} positions of this model's learned "
                         "position table")
    teacher = _load_teacher(model, args) if args.distill else None
    if args.stage == "attention" or args.feature_maps_only:
        train_only_feature_maps(model)
    if args.lora_rank:
        model = with_lora(model, args.lora_rank, args.lora_alpha)
    redraw_interval = args.redraw_interval
    if redraw_interval is None:
        redraw_interval = performer_settings(model.config).redraw_interval or 0
    mark_redraws_applied(model)

    with accelerator.main_process_first():
        packed = pack(load_texts(args), tokenizer, args.max_length, args.text_column,
                      by_document=_by_document(model, args.packing))
    train_set, eval_set = packed["train"], packed["validation"]
    if args.max_train_samples:
        train_set = train_set.select(range(min(args.max_train_samples, len(train_set))))
    if args.max_eval_samples:
        eval_set = eval_set.select(range(min(args.max_eval_samples, len(eval_set))))
    def collator():
        mlm = task == "masked-lm" and args.stage != "attention"  # attention transfer reads the plain text
        return SeededCollator(DataCollatorForLanguageModeling(tokenizer, mlm=mlm,
                                                              mlm_probability=args.mlm_probability), args.seed)

    train_collator = collator()
    # the loader's own generator: making an iterator after a resume must not consume the global RNG
    train_dl = DataLoader(with_index(train_set), shuffle=True, batch_size=args.batch_size, collate_fn=train_collator,
                          generator=torch.Generator().manual_seed(args.seed))
    eval_dl = DataLoader(with_index(eval_set), batch_size=args.batch_size, collate_fn=collator())

    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay, args.attention_only_steps > 0),
                                  lr=args.learning_rate)
    steps_per_epoch = math.ceil(len(train_dl) / max(1, accelerator.num_processes) / args.gradient_accumulation_steps)
    max_steps = args.max_steps or max(1, math.ceil(args.num_epochs * steps_per_epoch))
    scheduler = get_scheduler(args.lr_scheduler if args.lr_scheduler != "constant" else "constant_with_warmup",
                              optimizer, num_warmup_steps=int(args.warmup_ratio * max_steps),
                              num_training_steps=max_steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                         scheduler)
    if teacher is not None:  # not through accelerate: its checkpoints must not carry the frozen teacher
        teacher = teacher.to(accelerator.device)
    if args.report_to:
        accelerator.init_trackers("performer_hf", config={k: v for k, v in vars(args).items()
                                                           if isinstance(v, int | float | str | bool)})

    state = {"step": 0, "epoch": 0, "batches_in_epoch": 0}
    if args.resume:
        checkpoint = complete_checkpoints(out)[-1]
        exact = rng_state_readable(checkpoint, accelerator.process_index)
        try:
            accelerator.load_state(str(checkpoint))
        except Exception as err:  # a truncated or corrupt file of the checkpoint
            raise ValueError(f"--resume: {checkpoint} cannot be loaded ({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[0] if str(err).strip() else 'corrupt'}); delete it "
                             "to resume from the checkpoint before, or start again without --resume") from None
        state = json.loads((checkpoint / "loop_state.json").read_text())
        accelerator.print(f"resumed from {checkpoint} (step {state['step']})")
        if not exact:
            accelerator.print(f"--resume: the random state in {checkpoint} cannot be read; continuing with a fresh "
                              "one, so data order and masking differ from an uninterrupted run (not an exact resume)")
        if accelerator.is_main_process:
            cut_metrics(out / "metrics.jsonl", state["step"])  # steps after the checkpoint will be logged again

    if args.stage == "attention":
        ctx = AttentionTransfer(args, accelerator, model, task, out)
    else:
        ctx = EndToEnd(args, accelerator, model, task, out, teacher)
    # a sentence-transformers model stays one: its modules.json, pooling and normalisation go into the output
    ctx.source = str(model_or_path) if isinstance(model_or_path, str | Path) else None
    progress = tqdm(total=max_steps, initial=state["step"], desc="fine-tuning",
                    disable=not (args.progress and accelerator.is_local_main_process))
    tokens, last_log = 0, time.perf_counter()
    running, running_terms = [], {}
    while state["step"] < max_steps:
        train_dl.set_epoch(state["epoch"])
        train_collator.epoch = state["epoch"]
        batches = train_dl
        if state["batches_in_epoch"]:
            batches = accelerator.skip_first_batches(train_dl, state["batches_in_epoch"])
        for batch in batches:
            with accelerator.accumulate(model):
                loss, terms = ctx.loss(batch)
                if not bool(accelerator.gather(torch.isfinite(loss.detach()).reshape(1)).all()):
                    ctx.diverged(state["step"] + 1, loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if state["step"] < args.attention_only_steps:  # LoLCATs: match attention first
                    for group in optimizer.param_groups:
                        if group["name"].startswith("rest"):
                            group["lr"] = 0.0
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            state["batches_in_epoch"] += 1
            running.append(loss.detach().float())
            for name, value in terms.items():
                running_terms.setdefault(name, []).append(value)
            batch_tokens = int(batch["attention_mask"].sum()) * accelerator.num_processes
            tokens += batch_tokens
            state["tokens_seen"] = state.get("tokens_seen", 0) + batch_tokens
            if not accelerator.sync_gradients:
                continue
            state["step"] += 1
            progress.update(1)
            if redraw_interval and state["step"] % redraw_interval == 0:
                # the same seeded generator on every process keeps replicas identical
                redraw_projections(accelerator.unwrap_model(model),
                                   torch.Generator().manual_seed(args.seed * 1_000_003 + state["step"]))
            logs = {}
            if state["step"] % args.logging_steps == 0 or state["step"] == max_steps:
                mean_loss = accelerator.gather(torch.stack(running).mean().reshape(1)).mean().item()
                now = time.perf_counter()
                state["train_seconds"] = state.get("train_seconds", 0.0) + now - last_log
                logs = {"step": state["step"], "loss": mean_loss, "lr": scheduler.get_last_lr()[-1],
                        "tokens_per_s": tokens / (now - last_log), "epoch": state["epoch"],
                        "tokens_seen": state["tokens_seen"], "train_seconds": round(state["train_seconds"], 2)}
                for name, values in running_terms.items():  # each loss term on its own
                    local = torch.tensor([sum(values) / len(values)], device=accelerator.device)
                    logs[name] = accelerator.gather(local).mean().item()
                if "task_loss" in logs:
                    logs["perplexity"] = math.exp(min(logs["task_loss"], 50))
                running, running_terms, tokens, last_log = [], {}, 0, now
                ctx.log(logs)
                progress.set_postfix(loss=f"{mean_loss:.4f}")
            if args.eval_steps and state["step"] % args.eval_steps == 0 and state["step"] != max_steps:
                ctx.log(ctx.evaluate(eval_dl, state["step"]))
                last_log = time.perf_counter()  # evaluation time is not training time
            if args.save_steps and state["step"] % args.save_steps == 0 and state["step"] != max_steps:
                ctx.save_checkpoint(state)
            for callback in callbacks:
                callback(state["step"], logs)
            if state["step"] >= max_steps:
                break
        else:
            state["epoch"] += 1
            state["batches_in_epoch"] = 0
    progress.close()
    final = ctx.evaluate(eval_dl, state["step"])
    ctx.log(final)
    ctx.save_checkpoint(state)
    ctx.save_final(tokenizer, final)
    accelerator.end_training()
    return {**final, "output_dir": str(out)}
