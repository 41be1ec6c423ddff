"""What every training stage shares: logging, checkpoints, the final save. Each stage (`end_to_end`, `transfer`)
subclasses `Stage` with its own loss and evaluation; the loop in `loop.py` drives any of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..conversion import performer_settings

CHECKPOINTS = "checkpoints"
KEEP_CHECKPOINTS = 2


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped and the last complete checkpoint was kept."""


def complete_checkpoints(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()
             and (p / "loop_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def clean_partial_checkpoints(out: Path) -> None:
    """Remove checkpoints and final saves that a killed run left half-written (they never count as complete)."""
    for stale in [*(out / CHECKPOINTS).glob(".step_*.partial"), out / ".final.partial"]:
        shutil.rmtree(stale, ignore_errors=True)


def cut_metrics(metrics: Path, step: int) -> None:
    """Keep the rows of `metrics` up to `step`: a resumed run logs the later steps again."""
    if not metrics.is_file():
        return
    kept = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    tmp = metrics.with_suffix(".jsonl.partial")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(metrics)


def rng_state_readable(checkpoint: Path, process_index: int) -> bool:
    """Whether accelerate can restore this process's random state (it skips an unreadable one with a log line)."""
    from accelerate.utils import load  # torch.load(weights_only=True) with accelerate's allowlist (numpy state)

    try:
        states = load(checkpoint / f"random_states_{process_index}.pkl")
        return isinstance(states, dict) and "torch_manual_seed" in states
    except Exception:
        return False


class Stage:
    """One training stage: `loss(batch) -> (loss, logs)` and `evaluate(eval_dl, step) -> metrics` in subclasses."""

    description = "training"
    mlm_inputs = True  # masked-LM models get masked inputs (the attention stage wants the plain text)
    source: str | None = None  # the model directory or Hub id trained from (its sentence-transformers files are kept)

    def __init__(self, args, accelerator, model, task, out: Path):
        self.args, self.accelerator, self.model, self.task, self.out = args, accelerator, model, task, out
        self.metrics_file = out / "metrics.jsonl"

    @staticmethod
    def _inputs(batch):
        return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def final_model(self):
        """`(model, state dict)` to save at the end; the state dict gathered across processes (FSDP, DeepSpeed)."""
        return self.accelerator.unwrap_model(self.model), self.accelerator.get_state_dict(self.model)

    def diverged(self, step, loss):
        checkpoints = complete_checkpoints(self.out)
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
            for old in complete_checkpoints(self.out)[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def save_final(self, tokenizer, metrics: dict):
        from ..hub import model_card, push_directory
        from ..sentence import carry_files

        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            model, state_dict = self.final_model()
            tmp = self.out / ".final.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            if self.source:
                carry_files(self.source, tmp)
            report = "\n".join(["| metric | value |", "|---|---|"] +
                               [f"| {k} | {v:.4f} |" for k, v in metrics.items()
                                if k != "step" and isinstance(v, int | float)])
            base = (model.config.performer or {}).get("base_model")
            (tmp / "README.md").write_text(model_card(
                base_model=base, task=self.task, settings=performer_settings(model.config), report=report,
                model_type=model.config.model_type, location=self.args.push_to_hub or str(self.out),
                finetuned=f"Fine-tuned for {metrics['step']} steps after conversion ({self.description})."))
            for item in tmp.iterdir():
                item.replace(self.out / item.name)  # each file appears whole
            tmp.rmdir()
            if self.args.push_to_hub:
                push_directory(self.out, self.args.push_to_hub, private=self.args.private,
                               commit_message=f"Performer fine-tuned for {metrics['step']} steps")
        acc.wait_for_everyone()
