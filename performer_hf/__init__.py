"""performer_hf: turn pretrained Hugging Face Transformers into Performers (FAVOR+ linear attention).

>>> import performer_hf
>>> model = performer_hf.convert(model, performer_hf.PerformerConfig(num_features=256))  # doctest: +SKIP

The names below load on first use, so `import performer_hf` (and the `performer-hf` command, which must answer
Ctrl-C even while torch and transformers are still importing) costs nothing until something is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "supported_types": "architectures",
    "PerformerConfig": "config",
    "convert": "conversion",
    "converted_modules": "conversion",
    "from_pretrained": "conversion",
    "is_converted": "conversion",
    "performer_settings": "conversion",
    "redraw_projections": "conversion",
    "revert": "conversion",
    "PerformerCache": "generation",
    "load_sentence_transformer": "sentence",
    "RedrawCallback": "trainer",
}

__all__ = [
    "PerformerCache", "PerformerConfig", "RedrawCallback", "convert", "converted_modules", "from_pretrained",
    "is_converted", "load_sentence_transformer", "performer_settings", "redraw_projections", "revert",
    "supported_types", "__version__",
]

if TYPE_CHECKING:
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
    from .trainer import RedrawCallback


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    try:  # performer_hf.fidelity, performer_hf.training, ... without importing them first
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'performer_hf' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_EXPORTS})
