"""Training data: a Hub dataset, local files, or a built-in corpus (`performer_hf.corpus`); tokenised and packed
into fixed blocks."""

from __future__ import annotations

import codecs
import hashlib
import json
import math
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


def _check_text_file(path: str, flag: str, kind: str, text_column: str) -> None:
    """One line naming the file (and line) for data that would otherwise fail deep inside `datasets`: binary or
    non-UTF-8 bytes, a JSON line that does not parse or whose text is not a string."""
    if kind == "parquet":
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if b"\0" in chunk:
                raise ValueError(f"{flag} {path} is binary (a NUL byte at offset {offset + chunk.index(0)}); pass "
                                 "UTF-8 text (.txt, .jsonl, .csv)")
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                raise ValueError(f"{flag} {path} is not UTF-8 (near byte {offset + err.start}); re-encode it as "
                                 "UTF-8") from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{flag} {path} is not UTF-8 (it ends inside a character); re-encode it as UTF-8") \
                from None
    if kind != "json":
        return
    with open(path, encoding="utf-8") as f:
        first = f.read(1)
    if first == "[":  # one JSON array: datasets reads it whole
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{flag} {path}, line {number}: not valid JSON ({err.msg}); fix or remove the "
                                 "line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{flag} {path}, line {number}: a JSON {type(row).__name__}, not an object with "
                                 f"a {text_column!r} field")
            if text_column in row and not isinstance(row[text_column], str | type(None)):
                raise ValueError(f"{flag} {path}, line {number}: {text_column!r} is a {type(row[text_column]).__name__}"
                                 ", not text")


def _check_split_sizes(raw, args, source: str) -> None:
    rows = len(raw["train"])
    valid = math.ceil(rows * args.validation_percent / 100)
    if rows < 2 or rows - valid < 1 or valid < 1:
        raise ValueError(f"{source} has {rows} document{'s' if rows != 1 else ''} (one per line, or per row), too few "
                         f"to hold out {args.validation_percent}% for validation; pass --validation-file, or split the "
                         "text into more documents (lines)")


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
        kind = kinds.pop()
        for split, path in files.items():
            _check_text_file(path, f"--{split}-file", kind, args.text_column)
        try:
            raw = datasets.load_dataset(kind, data_files=files)
        except Exception as err:  # a malformed csv or parquet file: datasets raises its own types
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"--train-file {args.train_file} cannot be read as {kind} ({text})") from None
        source = f"--train-file {args.train_file}"
    elif args.dataset:
        try:
            raw = datasets.load_dataset(args.dataset, args.dataset_config)
        except Exception as err:  # the datasets library raises many types for "cannot reach / cannot find"
            from huggingface_hub import constants

            what = (f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            advice = ("it is not in the local cache and offline mode (HF_HUB_OFFLINE=1) is on; use --train-file with "
                      "local data, or unset HF_HUB_OFFLINE to download it") if constants.HF_HUB_OFFLINE else \
                ("use --train-file with local data, or set HF_HUB_OFFLINE=1 to use the local cache")
            raise OSError(f"cannot load dataset {args.dataset!r} ({what}); {advice}") from err
        source = f"--dataset {args.dataset}"
    else:
        train, valid = corpus_split(args.corpus, args.validation_percent)
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict({args.text_column: train}),
                                     "validation": datasets.Dataset.from_dict({args.text_column: valid})})
    if args.text_column not in raw["train"].column_names:
        raise ValueError(f"the training data has no column {args.text_column!r} (columns: "
                         f"{raw['train'].column_names}); pass --text-column")
    if len(raw["train"]) == 0:
        raise ValueError("the training data has no rows")
    for split in raw:
        if args.text_column not in raw[split].column_names:
            raise ValueError(f"{source}: the {split} split has no column {args.text_column!r}")
        dtype = getattr(raw[split].features[args.text_column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(f"{source}: column {args.text_column!r} of the {split} split holds {dtype}, not text; "
                             "pass --text-column with a text column")
    if "validation" not in raw:
        _check_split_sizes(raw, args, source)
        split = raw["train"].train_test_split(test_size=args.validation_percent / 100, seed=args.seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    return raw


def _special_wrapping(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after one text ([CLS] / [SEP], <s> / none, or none), read off
    a probe: transformers 5 tokenizers have no public call that wraps token ids already split."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    wrapped = tokenizer("a")["input_ids"]
    start = next((i for i in range(len(wrapped)) if wrapped[i : i + len(plain)] == plain), 0)
    return wrapped[:start], wrapped[start + len(plain) :]


def pack(raw, tokenizer, max_length: int, text_column: str, num_proc: int | None = None, by_document: bool = False):
    """Tokenise every text and cut it into training blocks of at most `max_length` tokens.

    By default the concatenation of all texts is cut into blocks of exactly `max_length` tokens (the remainder of each
    map batch is dropped), as the Hugging Face language-modelling examples do: right for causal LMs. With
    `by_document`, each block holds one piece of one document wrapped in the tokenizer's special tokens (`[CLS] ...
    [SEP]`), the last piece of a document shorter and padded by the collator: what an encoder sees when it embeds a
    text, so its attention (to [CLS], to [SEP], over padding) is trained as it is used.
    """

    def real_texts(batch):
        return [t for t in batch[text_column] if isinstance(t, str) and t.strip()]

    def tokenize(batch):
        return tokenizer(real_texts(batch), return_special_tokens_mask=True)

    def group(batch):
        joined = {k: list(chain.from_iterable(batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // max_length) * max_length
        return {k: [v[i : i + max_length] for i in range(0, total, max_length)] for k, v in joined.items()}

    columns = raw["train"].column_names
    if by_document:
        prefix, suffix = _special_wrapping(tokenizer)
        room = max_length - len(prefix) - len(suffix)
        if room < 1:
            raise ValueError(f"--max-length {max_length} leaves no room for text between the tokenizer's special "
                             "tokens")

        def split_documents(batch):
            rows, special = [], []
            for doc in tokenizer(real_texts(batch), add_special_tokens=False)["input_ids"]:
                for i in range(0, len(doc), room):
                    piece = doc[i : i + room]
                    rows.append(prefix + piece + suffix)
                    special.append([1] * len(prefix) + [0] * len(piece) + [1] * len(suffix))
            return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows],
                    "special_tokens_mask": special}

        packed = raw.map(split_documents, batched=True, remove_columns=columns, num_proc=num_proc,
                         desc=f"tokenising, pieces of {max_length}")
    else:
        tokenized = raw.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc, desc="tokenising")
        packed = tokenized.map(group, batched=True, batch_size=1000, num_proc=num_proc,
                               desc=f"packing {max_length}")
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
