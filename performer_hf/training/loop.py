"""The fine-tune loop: accelerate's canonical skeleton (as in transformers' run_mlm_no_trainer), driven by a
`FinetuneArgs` object so tests and the CLI call the same function.

Runs unchanged under `accelerate launch` on one CPU, one or several GPUs, or several machines (DDP, FSDP, DeepSpeed
through accelerate's own config). Checkpoints are accelerate `save_state` directories (model, optimizer, scheduler,
RNG) plus the loop's position, renamed into place only when complete, so a run killed at any moment resumes from
the newest complete one and replays exactly what an uninterrupted run would have done.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch

from ..architectures import lookup, position_limit
from ..conversion import converted_modules, from_pretrained, is_converted, performer_settings, redraw_projections
from ..hub import task_of_architecture
from .args import FinetuneArgs
from .data import SeededCollator, load_texts, pack, with_index
from .losses import hidden_mse, logit_kl

CHECKPOINTS = "checkpoints"
KEEP_CHECKPOINTS = 2


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped and the last complete checkpoint was kept."""


def _task_of(model, requested: str) -> str:
    if requested != "auto":
        return requested
    task = task_of_architecture(type(model).__name__)
    return task if task in ("masked-lm", "causal-lm") else "distill-only"


def _load_student(model_or_path, tokenizer):
    from transformers import AutoTokenizer

    if isinstance(model_or_path, str | Path):
        path = str(model_or_path)
        if not Path(path).exists() and path.startswith((".", "/")):
            raise FileNotFoundError(f"{path}: no such model directory")
        from transformers import AutoConfig

        if performer_settings(AutoConfig.from_pretrained(path)) is None:
            raise ValueError(f"{path} is not a converted model; convert it first: performer-hf convert {path} "
                             f"--out {path.rstrip('/')}-performer (or performer_hf.convert(model) in Python)")
        model = from_pretrained(path)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    else:
        model = model_or_path
        if not is_converted(model):
            raise ValueError("the model is not converted; call performer_hf.convert(model) first")
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _load_teacher(student, args: FinetuneArgs):
    from ..hub import LoadError, load_error_message

    source = args.teacher or (student.config.performer or {}).get("base_model")
    if not source:
        raise ValueError("no teacher: this model does not record the model it was converted from; pass --teacher")
    model_class = type(student)
    try:
        teacher = model_class.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise LoadError(f"teacher: {load_error_message(source, err)}") from err
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


def _complete_checkpoints(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()
             and (p / "loop_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _param_groups(model, weight_decay: float, attention_only: bool):
    """AdamW groups: no decay for biases and norms; with `attention_only`, the attention weights apart."""
    attention = {id(p) for name in converted_modules(model) for p in model.get_submodule(name).parameters()}
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = param.dim() >= 2 and "norm" not in name.lower()
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
    if args.resume and not _complete_checkpoints(out):
        raise FileNotFoundError(f"--resume: no complete checkpoint under {out / CHECKPOINTS}")
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
    if task == "distill-only" and not args.distill:
        raise ValueError(f"{type(model).__name__} has no language-model head: train it with --distill "
                         "(hidden-state matching to the original)")
    limit = position_limit(lookup(model.config.model_type), model.config)
    if limit is not None and args.max_length > limit:
        raise ValueError(f"--max-length {args.max_length} exceeds the {limit} positions of this model's learned "
                         "position table")
    teacher = _load_teacher(model, args) if args.distill else None
    redraw_interval = args.redraw_interval
    if redraw_interval is None:
        redraw_interval = performer_settings(model.config).redraw_interval or 0

    with accelerator.main_process_first():
        packed = pack(load_texts(args), tokenizer, args.max_length, args.text_column)
    train_set, eval_set = packed["train"], packed["validation"]
    if args.max_train_samples:
        train_set = train_set.select(range(min(args.max_train_samples, len(train_set))))
    if args.max_eval_samples:
        eval_set = eval_set.select(range(min(args.max_eval_samples, len(eval_set))))
    def collator():
        return SeededCollator(DataCollatorForLanguageModeling(tokenizer, mlm=task == "masked-lm",
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
    if teacher is not None:
        teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
    if args.report_to:
        accelerator.init_trackers("performer_hf", config={k: v for k, v in vars(args).items()
                                                           if isinstance(v, int | float | str | bool)})

    state = {"step": 0, "epoch": 0, "batches_in_epoch": 0}
    if args.resume:
        checkpoint = _complete_checkpoints(out)[-1]
        accelerator.load_state(str(checkpoint))
        state = json.loads((checkpoint / "loop_state.json").read_text())
        accelerator.print(f"resumed from {checkpoint} (step {state['step']})")

    ctx = _Context(args, accelerator, model, teacher, task, out)
    progress = tqdm(total=max_steps, initial=state["step"], desc="fine-tuning",
                    disable=not (args.progress and accelerator.is_local_main_process))
    tokens, last_log = 0, time.perf_counter()
    running = []
    while state["step"] < max_steps:
        train_dl.set_epoch(state["epoch"])
        train_collator.epoch = state["epoch"]
        batches = train_dl
        if state["batches_in_epoch"]:
            batches = accelerator.skip_first_batches(train_dl, state["batches_in_epoch"])
        for batch in batches:
            with accelerator.accumulate(model):
                loss, _, _ = ctx.loss(batch)
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
            tokens += int(batch["attention_mask"].sum()) * accelerator.num_processes
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
                logs = {"step": state["step"], "loss": mean_loss, "lr": scheduler.get_last_lr()[-1],
                        "tokens_per_s": tokens / (now - last_log), "epoch": state["epoch"]}
                if task != "distill-only" and args.distill is False:
                    logs["perplexity"] = math.exp(min(mean_loss, 50))
                running, tokens, last_log = [], 0, now
                ctx.log(logs)
                progress.set_postfix(loss=f"{mean_loss:.4f}")
            if args.eval_steps and state["step"] % args.eval_steps == 0 and state["step"] != max_steps:
                ctx.log(ctx.evaluate(eval_dl, state["step"]))
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


class _Context:
    """What the loop needs at each step: the loss, logging, evaluation and saving."""

    def __init__(self, args, accelerator, model, teacher, task, out):
        self.args, self.accelerator, self.model, self.teacher, self.task, self.out = (
            args, accelerator, model, teacher, task, out)
        self.metrics_file = out / "metrics.jsonl"
        self.accuracy = None
        if task == "masked-lm":  # loaded once; compute() clears what add_batch collected
            import evaluate

            self.accuracy = evaluate.load(str(Path(__file__).parents[1] / "metrics" / "accuracy"))

    def _inputs(self, batch):
        return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def loss(self, batch, keep_hidden: bool = False):
        """`(loss, student outputs, teacher outputs or None)`; `keep_hidden` returns hidden states even when the
        loss does not use them (evaluation compares them with the teacher's)."""
        args = self.args
        use_hidden = self.teacher is not None and args.hidden_weight > 0
        need_hidden = self.teacher is not None and (use_hidden or keep_hidden)
        labels = batch.get("labels") if self.task != "distill-only" else None
        out = self.model(**self._inputs(batch), labels=labels, output_hidden_states=need_hidden)
        loss = out.loss * args.task_weight if labels is not None and args.task_weight > 0 else 0.0
        ref = None
        if self.teacher is not None:
            with torch.no_grad(), self.accelerator.autocast():
                ref = self.teacher(**self._inputs(batch), output_hidden_states=need_hidden)
            mask = batch["attention_mask"]
            if getattr(out, "logits", None) is not None and args.kl_weight > 0:
                loss = loss + args.kl_weight * logit_kl(out.logits, ref.logits, mask, args.temperature)
            if use_hidden:
                loss = loss + args.hidden_weight * hidden_mse(out.hidden_states, ref.hidden_states, mask,
                                                              args.distill_layers)
        if not torch.is_tensor(loss):
            raise ValueError("every loss weight is zero: nothing to train")
        return loss, out, ref

    def diverged(self, step, loss):
        checkpoints = _complete_checkpoints(self.out)
        kept = f"the last good checkpoint is {checkpoints[-1]} (resume with --resume, perhaps with a lower " \
               "--learning-rate)" if checkpoints else "no checkpoint had been saved yet (use --save-steps)"
        raise TrainingDiverged(f"loss became {loss.item()} at step {step}; training stopped and {kept}")

    def log(self, logs: dict):
        if not logs:
            return
        if self.args.report_to:
            self.accelerator.log({k: v for k, v in logs.items() if k != "step"}, step=logs["step"])
        if self.accelerator.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            with self.metrics_file.open("a") as f:
                f.write(json.dumps(logs) + "\n")

    @torch.no_grad()
    def evaluate(self, eval_dl, step) -> dict:
        self.model.eval()
        losses, cosines = [], []
        with torch.random.fork_rng(devices=[]):  # fixed eval masks; the training RNG stream is untouched
            torch.manual_seed(self.args.seed)
            for batch in eval_dl:
                loss, out, ref = self.loss(batch, keep_hidden=True)  # one forward each serves every metric
                losses.append(self.accelerator.gather_for_metrics(loss.detach().float().reshape(1)))
                if self.task == "masked-lm":
                    chosen = batch["labels"] != -100
                    preds, refs = self.accelerator.gather_for_metrics((out.logits.argmax(-1)[chosen],
                                                                       batch["labels"][chosen]))
                    self.accuracy.add_batch(predictions=preds.tolist(), references=refs.tolist())
                if ref is not None:
                    student, teacher = out.hidden_states[-1], ref.hidden_states[-1]
                    cos = torch.nn.functional.cosine_similarity(student.float(), teacher.float(), dim=-1)
                    real = batch["attention_mask"].bool()
                    cosines.append(self.accelerator.gather_for_metrics(cos[real].mean().reshape(1)))
        self.model.train()
        result = {"step": step, "eval_loss": torch.cat(losses).mean().item()}
        if self.task in ("masked-lm", "causal-lm") and not self.args.distill:
            result["eval_perplexity"] = math.exp(min(result["eval_loss"], 50))
        if self.task == "masked-lm":
            result["eval_masked_accuracy"] = self.accuracy.compute()["accuracy"]
        if cosines:
            result["eval_hidden_cosine_to_teacher"] = torch.cat(cosines).mean().item()
        return result

    def save_checkpoint(self, state: dict):
        acc, root = self.accelerator, self.out / CHECKPOINTS
        final = root / f"step_{state['step']}"
        tmp = root / f".step_{state['step']}.partial"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            (tmp / "loop_state.json").write_text(json.dumps(state))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)  # complete checkpoints only ever exist under their final name
            for old in _complete_checkpoints(self.out)[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def save_final(self, tokenizer, metrics: dict):
        from ..hub import model_card, push_directory

        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            model = acc.unwrap_model(self.model)
            tmp = self.out / ".final.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp, state_dict=acc.get_state_dict(self.model))
            tokenizer.save_pretrained(tmp)
            report = "\n".join(["| metric | value |", "|---|---|"] +
                               [f"| {k} | {v:.4f} |" for k, v in metrics.items() if k != "step"])
            base = (model.config.performer or {}).get("base_model")
            (tmp / "README.md").write_text(model_card(
                base_model=base, task=self.task, settings=performer_settings(model.config), report=report,
                model_type=model.config.model_type, location=self.args.push_to_hub or str(self.out),
                finetuned=f"Fine-tuned for {metrics['step']} steps after conversion "
                          f"({'distillation from the original' if self.teacher is not None else self.task})."))
            for item in tmp.iterdir():
                item.replace(self.out / item.name)  # each file appears whole
            tmp.rmdir()
            if self.args.push_to_hub:
                push_directory(self.out, self.args.push_to_hub, private=self.args.private,
                               commit_message=f"Performer fine-tuned for {metrics['step']} steps")
        acc.wait_for_everyone()
