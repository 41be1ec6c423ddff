"""Fine-tuning converted models back towards their originals (accelerate loop, masked/causal LM, distillation)."""

from ..corpus import builtin_corpus
from .args import FinetuneArgs
from .context import TrainingDiverged
from .loop import finetune

__all__ = ["FinetuneArgs", "TrainingDiverged", "builtin_corpus", "finetune"]
