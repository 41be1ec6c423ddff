"""sentence-transformers models: converting one keeps it one, and one call loads the Performer into it.

A sentence-transformers model is a transformers model plus `modules.json`, which names the modules applied after it
(pooling, normalisation, dense layers) and the folders that configure them. `performer-hf convert` and `finetune`
carry those files into their output (`carry_files`), so the result still loads as a `SentenceTransformer`;
`load_sentence_transformer` then puts the Performer in place of the softmax model that sentence-transformers would
load from the same folder (config.json asks for `attn_implementation="performer"`, so a plain
`SentenceTransformer(path)` fails at its first `encode` rather than silently embedding with softmax attention).

Only modules of sentence-transformers itself are carried (a `modules.json` naming other code is refused: loading it
would import that code), and only JSON configuration and safetensors weights: never pickles.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from transformers.utils import cached_file

TOP_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
MODULE_FILES = ("config.json", "model.safetensors")


def sentence_transformer_files(source: str, **hub_kwargs: Any) -> dict[str, str]:
    """{path inside the model folder: local file} of the sentence-transformers files of `source` (a local folder or
    a Hub id); empty for a plain transformers model.

    Raises:
        ValueError: `modules.json` names a module outside sentence-transformers, or a module whose weights are only
            in a pickle file.
    """
    def fetch(name: str) -> str | None:
        return cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub_kwargs)

    modules_file = fetch("modules.json")
    if modules_file is None:
        return {}
    try:
        modules = json.loads(Path(modules_file).read_text(encoding="utf-8"))
        entries = [(str(m["type"]), str(m.get("path", ""))) for m in modules]
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{source}: modules.json is not a sentence-transformers module list ({err})") from None
    files = {}
    for name in TOP_FILES:
        found = fetch(name)
        if found is not None:
            files[name] = found
    for kind, folder in entries:
        if not kind.startswith("sentence_transformers."):
            raise ValueError(f"{source}: modules.json names {kind!r}, which is not a sentence-transformers module; "
                             "models with custom module code are not supported")
        if not folder:  # the transformers model itself
            continue
        if Path(folder).is_absolute() or ".." in Path(folder).parts:
            raise ValueError(f"{source}: modules.json points outside the model folder ({folder!r})")
        for name in MODULE_FILES:
            found = fetch(f"{folder}/{name}")
            if found is not None:
                files[f"{folder}/{name}"] = found
        if f"{folder}/model.safetensors" not in files and fetch(f"{folder}/pytorch_model.bin") is not None:
            raise ValueError(f"{source}: module {folder} keeps its weights only in pytorch_model.bin (a pickle, "
                             "never loaded here); re-save it with safetensors first")
    return files


def copy_files(files: dict[str, str], target: Path) -> list[str]:
    """Copy `sentence_transformer_files` output into the folder `target`; returns what was copied."""
    for name, file in files.items():
        destination = Path(target) / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, destination)
    return list(files)


def carry_files(source: str, target: Path, **hub_kwargs: Any) -> list[str]:
    """Copy the sentence-transformers files of `source` into `target` (not config.json or weights of the
    transformers model, which `save_pretrained` wrote); returns what was copied."""
    return copy_files(sentence_transformer_files(source, **hub_kwargs), target)


def load_sentence_transformer(path: str, device: str | None = None, **kwargs: Any):
    """A `SentenceTransformer` of a converted sentence-transformers model, running the Performer.

    `kwargs` go to `SentenceTransformer` (e.g. `revision`, `token`); custom code is never trusted.

    Example:
        >>> st = performer_hf.load_sentence_transformer("minilm-performer")  # doctest: +SKIP
        >>> st.encode(["a sentence"]).shape  # doctest: +SKIP
        (1, 384)
    """
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ImportError("load_sentence_transformer needs sentence-transformers: "
                          "pip install 'performer-hf[sentence-transformers]'") from None
    from .attention import register
    from .conversion import from_pretrained

    register()  # config.json asks for attn_implementation="performer"
    hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
    if not sentence_transformer_files(path, **hub_kwargs):
        raise ValueError(f"{path} has no modules.json: it is not a sentence-transformers model; load it with "
                         "performer_hf.from_pretrained")
    st = SentenceTransformer(path, device="cpu", trust_remote_code=False, **kwargs)
    transformer = st[0]
    if not hasattr(transformer, "model"):
        raise ValueError(f"{path}: the first sentence-transformers module is {type(transformer).__name__}, not a "
                         "Transformer")
    dtype = next(transformer.model.parameters()).dtype
    transformer.model = from_pretrained(path, dtype=dtype, **hub_kwargs)  # the Performer, with its projections
    return st.to(device) if device is not None else st
