"""Fine-tuning converted models back towards their originals (accelerate loop, masked/causal LM, distillation)."""

from .args import FinetuneArgs
from .data import builtin_corpus
from .loop import TrainingDiverged, finetune

__all__ = ["FinetuneArgs", "TrainingDiverged", "builtin_corpus", "finetune"]
