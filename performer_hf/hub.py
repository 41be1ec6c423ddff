"""Loading from and publishing to the Hugging Face Hub: clear errors, atomic output directories, model cards."""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .config import PerformerConfig

TASKS = ("auto", "base", "masked-lm", "causal-lm", "sequence-classification")
TASK_CLASSES = {
    "base": "AutoModel",
    "masked-lm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}
PIPELINE_TAGS = {"base": "feature-extraction", "masked-lm": "fill-mask", "causal-lm": "text-generation",
                 "sequence-classification": "text-classification"}


class LoadError(OSError):
    """A model or tokenizer that could not be loaded, with what to do about it."""


# performer-hf never runs a model repository's own Python code (config `auto_map`); every transformers load passes this
NO_REMOTE_CODE = {"trust_remote_code": False}


def custom_code_message(model_id: str) -> str:
    return (f"{model_id} needs its own Python code (auto_map in its config); performer-hf never runs a model's custom "
            "code, so custom-code models are not supported: use a model whose architecture transformers ships")


def refuse_custom_code(model_id: str, config) -> None:
    """A LoadError for a config that maps its classes to the repository's own code."""
    if getattr(config, "auto_map", None):
        raise LoadError(custom_code_message(model_id))


def load_error_message(model_id: str, err: BaseException) -> str:
    """One line saying why `model_id` could not be loaded and what to try."""
    if not isinstance(err, OSError | ValueError) and type(err).__name__ != "SafetensorError":
        raise err  # a bug, not a loading problem: keep its traceback
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    looks_local = model_id.startswith((".", "/", "~")) or os.sep in model_id.rstrip(os.sep).split(os.sep, 1)[-1]
    if looks_local and not Path(model_id).expanduser().exists():
        return f"{model_id}: no such directory"
    if "trust_remote_code" in str(err) or "custom code" in str(err):
        return custom_code_message(model_id)
    if type(err).__name__ == "SafetensorError":
        return f"{model_id}: a safetensors weight file is truncated or corrupt ({text}); re-download or re-save it"
    if "safetensors" in text and ("no file named" in text or "does not appear to have" in text):
        return (f"{model_id} has no safetensors weights, only a pickled pytorch_model.bin, which performer-hf never "
                "loads (a pickle can run code); re-save it with save_pretrained (safetensors) and convert that")
    if isinstance(err, GatedRepoError) or "gated" in text.lower():
        return (f"{model_id} is a gated model: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN), "
                "or pass a local directory")
    if isinstance(err, RepositoryNotFoundError) or "not a valid model identifier" in text:
        return (f"{model_id} was not found on the Hub (misspelt, private without a token, or not a model); "
                "pass a Hub id like 'bert-base-uncased' or a local directory")
    if constants.HF_HUB_OFFLINE:
        return (f"cannot load {model_id} in offline mode (HF_HUB_OFFLINE=1) and it is not in the local cache; "
                "pass a local directory")
    return (f"cannot load {model_id} ({text}); if the Hub is unreachable, pass a local directory, or set "
            "HF_HUB_OFFLINE=1 to use the local cache")


def resolve_task(config, task: str) -> str:
    """The task from `config.architectures` when `task == "auto"`."""
    if task != "auto":
        return task
    return task_of_architecture((config.architectures or [""])[0])


def task_of_architecture(architecture: str) -> str:
    """The task a head class (e.g. `BertForMaskedLM`) serves; "base" for anything else."""
    if architecture.endswith("ForMaskedLM"):
        return "masked-lm"
    if architecture.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    if architecture.endswith("ForSequenceClassification"):
        return "sequence-classification"
    return "base"


def split_gguf(model_id: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """`(directory or Hub id, GGUF file name or None)`: a path to a `.gguf` file stands for its directory and name."""
    path = Path(model_id).expanduser()
    if gguf_file is None and path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise LoadError(f"{model_id}: no such GGUF file")
        return str(path.parent), path.name
    return model_id, gguf_file


def dequantized(model):
    """A plain copy of a model that transformers loaded from a GGUF file.

    transformers dequantises GGUF tensors on load but keeps the model marked as quantized, and such a model refuses
    `save_pretrained`. The same class built from the config without its quantization settings, with the same state
    dict, gives identical outputs and saves normally.
    """
    import copy

    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    dtype = next(model.parameters()).dtype
    plain = type(model)(config).to(dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise ValueError(f"the GGUF checkpoint does not map onto {type(model).__name__}: missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    plain.tie_weights()
    return plain.eval()


def load_pretrained(model_id: str, task: str = "auto", gguf_file: str | None = None, **kwargs):
    """Load `(model, tokenizer, task)` for conversion; every failure is a `LoadError` or a `ValueError` (unsupported
    architecture, checked from the config before any weights are fetched).

    `gguf_file` (or a `model_id` that is a path to a `.gguf` file) loads a GGUF checkpoint with the `gguf` package,
    dequantised to a plain float32 model that converts and saves like any other.
    """
    import transformers

    from .architectures import lookup

    model_id, gguf_file = split_gguf(model_id, gguf_file)
    if gguf_file is not None:
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise LoadError("reading GGUF checkpoints needs the gguf package: pip install gguf") from None
        kwargs = {**kwargs, "gguf_file": gguf_file}
    if kwargs.get("trust_remote_code"):
        raise LoadError(custom_code_message(model_id))
    kwargs = {**kwargs, **NO_REMOTE_CODE}
    try:
        config = transformers.AutoConfig.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as err:
        raise LoadError(load_error_message(model_id, err)) from err
    refuse_custom_code(model_id, config)
    lookup(config.model_type)  # refuse unsupported architectures before downloading weights
    task = resolve_task(config, task)
    if task == "base" and gguf_file is not None and config.model_type in ("llama", "mistral", "qwen2", "qwen3",
                                                                          "phi3", "gpt2", "gpt_neox"):
        task = "causal-lm"  # GGUF files hold language models; their config names no head class
    weights = {} if gguf_file is not None else {"use_safetensors": True}  # never a pickled pytorch_model.bin
    try:
        model = getattr(transformers, TASK_CLASSES[task]).from_pretrained(model_id, config=config, **kwargs,
                                                                          **weights)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_id, **kwargs)
    except Exception as err:  # safetensors raises its own error type for truncated files
        raise LoadError(load_error_message(model_id, err)) from err
    if gguf_file is not None:
        model = dequantized(model)
        # the model's source is the GGUF file itself: a conversion records it, and distillation finds the teacher
        model.config._name_or_path = str(Path(model_id) / gguf_file)
    return model.eval(), tokenizer, task


def check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it, or choose another --out")


@contextlib.contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Write into a temporary directory beside `out`; rename it to `out` only when the block completes.

    On any failure the temporary directory is removed and an existing `out` is left as it was.
    """
    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{glob.escape(out.name)}.partial-*"):  # left by a killed run (its pid is gone)
        if not _alive(stale.name.removeprefix(f".{out.name}.partial-").split("-", 1)[0]):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename: give the user's normal permissions
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: str) -> bool:
    """Whether the process `pid` (a string from a directory name) still runs; unparsable names count as alive."""
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def model_card(*, base_model: str | None, task: str, settings: PerformerConfig, report: str | None,
               model_type: str, location: str, finetuned: str | None = None) -> str:
    """README.md with Hub metadata and a body saying what was converted, how well it matches, how to use it."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        base_model=base_model if base_model and not Path(base_model).exists() else None,
        library_name="performer-hf",
        pipeline_tag=PIPELINE_TAGS.get(task),
        tags=["performer", "favor", "linear-attention", "performer-hf", model_type],
    )
    finetune_task = task if task in ("masked-lm", "causal-lm") else "masked-lm"
    settings_rows = "\n".join(f"| {k} | {v} |" for k, v in settings.to_dict().items())
    source = base_model or "a local model"
    fidelity = report or "(not measured)"
    status = finetuned or ("Converted without fine-tuning: a converted model starts away from its original and "
                           "needs a short fine-tune (see below) to recover its accuracy.")
    body = f"""
# {model_type} Performer converted from {source}

Every self-attention layer of [{source}]({'https://huggingface.co/' + base_model if data.base_model else ''}) runs
FAVOR attention (random-feature approximation of softmax attention, Choromanski et al. 2020) instead of exact
softmax attention: linear time and memory in the sequence length. The query, key, value and output weights are the
original ones; each layer adds a random projection, saved in the weights file.

{status}

## Settings

| setting | value |
|---|---|
{settings_rows}

## Fidelity to the original model

Measured on held-out sentences, converted vs original on the same tokens:

{fidelity}

## Use

```python
import performer_hf

model = performer_hf.from_pretrained("{location}")
```

Loading it with plain `transformers` gives the original softmax model (the projections are then unused).

## Fine-tune

```bash
performer-hf finetune {location} --out {location.rstrip('/').split('/')[-1]}-finetuned --task {finetune_task} --distill
```
"""
    return f"---\n{data.to_yaml()}\n---\n{body}"


# What a model repository holds: the model, its tokenizer and generation settings, the card and fidelity report,
# and a sentence-transformers model's module files. Nothing else in a directory is ever uploaded.
MODEL_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "model-[0-9]*-of-[0-9]*.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "README.md", "fidelity.json",
)


def upload_plan(directory: Path) -> tuple[list[str], list[str]]:
    """`(files to upload, files left out)` of a model directory, as paths relative to it.

    Uploaded: the top-level files a model repository holds (`MODEL_FILES`) and the JSON configuration and safetensors
    weights of the sentence-transformers modules named in `modules.json`. Left out: everything else (optimizer and RNG
    states, checkpoints, metrics, logs, dotfiles such as `.env`, files in other folders) and any symbolic link, whose
    target could lie outside the directory.
    """
    from .sentence import MODULE_FILES, TOP_FILES

    directory = Path(directory)
    wanted = [name for name in (p.name for p in sorted(directory.iterdir()))
              if any(fnmatch.fnmatchcase(name, pattern) for pattern in (*MODEL_FILES, *TOP_FILES))]
    modules = directory / "modules.json"
    if modules.is_file() and not modules.is_symlink():
        try:
            folders = [str(m.get("path", "")) for m in json.loads(modules.read_text(encoding="utf-8"))]
        except (ValueError, TypeError, AttributeError):
            folders = []
        wanted += [f"{folder}/{name}" for folder in folders if folder and ".." not in Path(folder).parts
                   and not Path(folder).is_absolute() for name in MODULE_FILES]
    upload = []
    for name in wanted:
        path = directory / name
        # no link anywhere on the way (the file itself included): a linked folder or file could point out
        links = [part for part in [path, *path.parents] if part.is_symlink() and directory in part.parents]
        if path.is_file() and not links:
            upload.append(name)
    everything = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() or p.is_symlink())
    return upload, [name for name in everything if name not in upload]


def push_directory(directory: Path, repo_id: str, *, private: bool = False, commit_message: str | None = None) -> str:
    """Upload the model files of `directory` (see `upload_plan`) to the Hub repository `repo_id` (created if
    missing); prints what is uploaded and what is left out, and returns the commit URL.

    The token comes from the usual places (HF_TOKEN, or the saved `hf auth login`) and is never printed. The
    directory is only read.
    """
    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json: it is not a saved model directory")
    upload, left_out = upload_plan(directory)
    if "config.json" not in upload:
        raise FileNotFoundError(f"{directory}/config.json is a link; copy the real file into {directory}")
    if get_token() is None:
        raise PermissionError("no Hugging Face token: set HF_TOKEN or run `hf auth login`; nothing was uploaded")
    print(f"uploading {len(upload)} files to {repo_id}: {', '.join(upload)}")
    if left_out:
        shown = ", ".join(left_out[:12]) + (f" and {len(left_out) - 12} more" if len(left_out) > 12 else "")
        print(f"left out (not part of a model repository, or a link): {shown}")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(directory / name)) for name in upload]
        info = api.create_commit(repo_id, operations, repo_type="model",
                                 commit_message=commit_message or f"Upload Performer from {directory.name}")
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        why = {401: "the token was refused", 403: "the token has no write access to this repository"}.get(
            status, f"the Hub answered HTTP {status}")
        raise PermissionError(f"push to {repo_id} failed: {why}; {directory} is unchanged") from err
    except ValueError:  # a malformed repository id: its own message says what is wrong
        raise
    except Exception as err:  # transport failures (huggingface_hub's HTTP client raises its own, non-OSError types)
        raise ConnectionError(f"push to {repo_id} failed: the Hub is unreachable ({type(err).__name__}); "
                              f"{directory} is unchanged") from err
    return str(getattr(info, "commit_url", info))
