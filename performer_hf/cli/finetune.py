"""`performer-hf finetune MODEL_DIR --out DIR`: recover accuracy after conversion (accelerate loop)."""

from __future__ import annotations

from ..training.args import FinetuneArgs as Args  # the same dataclass feeds finetune() and the flags

NAME = "finetune"
HELP = "fine-tune a converted model (masked/causal LM, distillation from the original); runs under accelerate launch"
POSITIONAL = (("model_dir", "a converted model directory or Hub id (from performer-hf convert)"),)

__all__ = ["Args", "run"]


def run(args: Args, model_dir: str) -> int:
    from ..training import finetune

    result = finetune(model_dir, args)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
    print(f"fine-tuned {model_dir} -> {result['output_dir']} ({shown})")
    return 0
