"""Training data: a Hub dataset, local files, or a built-in corpus (`performer_hf.corpus`); tokenised and packed
into fixed blocks."""

from __future__ import annotations

import hashlib
from itertools import chain
from pathlib import Path

import torch

from ..corpus import corpus_split


def _file_format(path: str) -> str:
    suffix = Path(path).suffix.lower()
    formats = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
               ".parquet": "parquet"}
    if suffix not in formats:
        raise ValueError(f"{path}: unsupported data file type {suffix!r}; use .txt, .json, .jsonl, .csv or .parquet")
    return formats[suffix]


def load_texts(args):
    """A DatasetDict with "train" and "validation" splits and one text column named `args.text_column`."""
    import datasets

    if args.train_file:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
        for split, path in files.items():
            if not Path(path).is_file():
                raise FileNotFoundError(f"--{split}-file {path}: no such file")
            if Path(path).stat().st_size == 0:
                raise ValueError(f"--{split}-file {path} is empty")
        kinds = {_file_format(p) for p in files.values()}
        if len(kinds) > 1:
            raise ValueError(f"train and validation files must have the same type, got {sorted(kinds)}")
        raw = datasets.load_dataset(kinds.pop(), data_files=files)
    elif args.dataset:
        try:
            raw = datasets.load_dataset(args.dataset, args.dataset_config)
        except Exception as err:  # the datasets library raises many types for "cannot reach / cannot find"
            raise OSError(f"cannot load dataset {args.dataset!r} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); use --train-file with local data, or "
                          "set HF_HUB_OFFLINE=1 to use the cache") from err
    else:
        train, valid = corpus_split(args.corpus, args.validation_percent)
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict({args.text_column: train}),
                                     "validation": datasets.Dataset.from_dict({args.text_column: valid})})
    if args.text_column not in raw["train"].column_names:
        raise ValueError(f"the training data has no column {args.text_column!r} (columns: "
                         f"{raw['train'].column_names}); pass --text-column")
    if len(raw["train"]) == 0:
        raise ValueError("the training data has no rows")
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=args.validation_percent / 100, seed=args.seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    return raw


def pack(raw, tokenizer, max_length: int, text_column: str, num_proc: int | None = None):
    """Tokenise every text and cut the concatenation into blocks of exactly `max_length` tokens (the remainder of
    each map batch is dropped), as the Hugging Face language-modelling examples do."""

    def tokenize(batch):
        texts = [t for t in batch[text_column] if isinstance(t, str) and t.strip()]
        return tokenizer(texts, return_special_tokens_mask=True)

    def group(batch):
        joined = {k: list(chain.from_iterable(batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // max_length) * max_length
        return {k: [v[i : i + max_length] for i in range(0, total, max_length)] for k, v in joined.items()}

    columns = raw["train"].column_names
    tokenized = raw.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc,
                        desc="tokenising")
    packed = tokenized.map(group, batched=True, batch_size=1000, num_proc=num_proc, desc=f"packing {max_length}")
    if len(packed["train"]) == 0:
        raise ValueError(f"the training data is shorter than one block of {max_length} tokens; add data or lower "
                         "--max-length")
    return packed


INDEX_COLUMN = "example_index"


def with_index(dataset):
    """Add each example's position as a column, so that `SeededCollator` can seed by it."""
    return dataset.map(lambda _, i: {INDEX_COLUMN: i}, with_indices=True, desc="indexing")


class SeededCollator:
    """Wraps a transformers collator so that each batch's random masking is seeded by (seed, epoch, the indices of
    its examples), not by the global RNG.

    Data loaders fetch a batch ahead of the step that uses it, so with global-RNG masking a resumed run would mask
    differently from an uninterrupted one. Seeding by content makes the masks a function of the batch alone.
    """

    def __init__(self, collator, seed: int):
        self.collator, self.seed, self.epoch = collator, seed, 0

    def __call__(self, examples):
        indices = [int(example.pop(INDEX_COLUMN)) for example in examples]
        digest = hashlib.sha1(repr((self.seed, self.epoch, indices)).encode()).digest()
        self.collator.generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        return self.collator(examples)
