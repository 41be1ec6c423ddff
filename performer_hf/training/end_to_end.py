"""The end-to-end stage: the whole model (or LoRA adapters on it) trains on the task loss and/or distillation from
the original softmax model (KL on logits, MSE on hidden states)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .context import Stage
from .losses import embedding_cosine_loss, hidden_mse, logit_kl


def with_lora(model, rank: int, alpha: float):
    """Wrap `model` in peft LoRA adapters on every linear layer but the output head; learned FAVOR projections
    stay trainable. `EndToEnd.final_model` merges the adapters back before saving."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("--lora-rank needs peft: pip install 'performer-hf[lora]'") from None
    wrapped = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear"))
    for name, param in wrapped.named_parameters():
        if name.endswith("performer.projection"):
            param.requires_grad_(True)
    return wrapped


class EndToEnd(Stage):
    """Task loss plus, with a teacher, distillation; every loss term is reported on its own."""

    def __init__(self, args, accelerator, model, task, out: Path, teacher=None):
        super().__init__(args, accelerator, model, task, out)
        self.teacher = teacher
        self.description = "distillation from the original" if teacher is not None else task
        if args.lora_rank:
            self.description += f", LoRA rank {args.lora_rank} merged"
        self.accuracy = None
        if task == "masked-lm":  # loaded once; compute() clears what add_batch collected
            import evaluate

            self.accuracy = evaluate.load(str(Path(__file__).parents[1] / "metrics" / "accuracy"))

    def final_model(self):
        if not self.args.lora_rank:
            return super().final_model()
        merged = self.accelerator.unwrap_model(self.model).merge_and_unload()  # a plain converted model again
        return merged, merged.state_dict()

    def forward(self, batch, keep_hidden: bool = False):
        """`(loss, terms, student outputs, teacher outputs or None)`; `terms` holds each loss term as a float.
        `keep_hidden` returns hidden states even when the loss does not use them (evaluation compares them)."""
        args = self.args
        use_hidden = self.teacher is not None and args.hidden_weight > 0
        use_embedding = self.teacher is not None and args.embedding_weight > 0
        need_hidden = self.teacher is not None and (use_hidden or use_embedding or keep_hidden)
        labels = batch.get("labels") if self.task != "distill-only" else None
        out = self.model(**self._inputs(batch), labels=labels, output_hidden_states=need_hidden)
        terms, loss, ref = {}, 0.0, None
        if labels is not None:
            terms["task_loss"] = out.loss.detach().float().item()
            if args.task_weight > 0:
                loss = out.loss * args.task_weight
        if self.teacher is not None:
            with torch.no_grad(), self.accelerator.autocast():
                ref = self.teacher(**self._inputs(batch), output_hidden_states=need_hidden)
            mask = batch["attention_mask"]
            if getattr(out, "logits", None) is not None and args.kl_weight > 0:
                kl = logit_kl(out.logits, ref.logits, mask, args.temperature)
                terms["kl_loss"] = kl.detach().float().item()
                loss = loss + args.kl_weight * kl
            if use_hidden:
                mse = hidden_mse(out.hidden_states, ref.hidden_states, mask, args.distill_layers)
                terms["hidden_loss"] = mse.detach().float().item()
                loss = loss + args.hidden_weight * mse
            if use_embedding:
                cos = embedding_cosine_loss(out.hidden_states[-1], ref.hidden_states[-1], mask)
                terms["embedding_loss"] = cos.detach().float().item()
                loss = loss + args.embedding_weight * cos
        if not torch.is_tensor(loss):
            raise ValueError("every loss weight is zero: nothing to train")
        return loss, terms, out, ref

    def loss(self, batch):
        loss, terms, _, _ = self.forward(batch)
        return loss, terms

    @torch.no_grad()
    def evaluate(self, eval_dl, step) -> dict:
        self.model.eval()
        losses, cosines, task_losses = [], [], []
        with torch.random.fork_rng(devices=[]):  # fixed eval masks; the training RNG stream is untouched
            torch.manual_seed(self.args.seed)
            for batch in eval_dl:
                loss, terms, out, ref = self.forward(batch, keep_hidden=True)  # one forward serves every metric
                losses.append(self.accelerator.gather_for_metrics(loss.detach().float().reshape(1)))
                if "task_loss" in terms:
                    task_losses.append(self.accelerator.gather_for_metrics(out.loss.detach().float().reshape(1)))
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
        if task_losses:
            result["eval_task_loss"] = torch.cat(task_losses).mean().item()
            result["eval_perplexity"] = math.exp(min(result["eval_task_loss"], 50))
        if self.task == "masked-lm":
            result["eval_masked_accuracy"] = self.accuracy.compute()["accuracy"]
        if cosines:
            result["eval_hidden_cosine_to_teacher"] = torch.cat(cosines).mean().item()
        return result
