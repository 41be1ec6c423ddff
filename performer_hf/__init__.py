"""performer_hf: turn pretrained Hugging Face Transformers into Performers (FAVOR+ linear attention)."""

__version__ = "0.1.0"
