"""performer_hf: turn pretrained Hugging Face Transformers into Performers (FAVOR+ linear attention).

>>> import performer_hf
>>> model = performer_hf.convert(model, performer_hf.PerformerConfig(num_features=256))  # doctest: +SKIP
"""

from .architectures import supported_types
from .config import PerformerConfig
from .conversion import (
    convert,
    converted_modules,
    from_pretrained,
    is_converted,
    performer_settings,
    redraw_projections,
    revert,
)
from .generation import PerformerCache
from .sentence import load_sentence_transformer


def __getattr__(name):  # transformers' Trainer machinery loads only for those who use it
    if name == "RedrawCallback":
        from .trainer import RedrawCallback

        return RedrawCallback
    raise AttributeError(f"module 'performer_hf' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "PerformerCache", "PerformerConfig", "RedrawCallback", "convert", "converted_modules", "from_pretrained",
    "is_converted", "load_sentence_transformer", "performer_settings",
    "redraw_projections", "revert", "supported_types", "__version__",
]
