"""Offline English training and evaluation text, built on the machine from what is installed (no download).

Three corpora:

- "stdlib": prose paragraphs from the docstrings of ~120 standard-library modules (about 1,800 paragraphs, 240 kB
  on Python 3.11). Imports only the standard library; quick, for tests and short runs.
- "installed": prose paragraphs from the docstrings of every Python source file of the standard library and the
  installed distributions (parsed with `ast`, never imported, so no installed code runs), plus every distribution's
  description; deduplicated by paragraph. About 9 MB in 7,800 documents with this project's extras installed. Built
  once per environment (about a minute on 2 cores) and cached under `~/.cache/performer_hf`.

- "prose": about 2,000 short everyday-English paragraphs (stories, descriptions, plain facts on a hundred everyday
  subjects) sampled once from SmolLM2-135M-Instruct by `finetune/generate_prose.py` and shipped with the package
  (`data/prose.txt.gz`). Documentation is not how most text reads: a sentence-embedding model recovered on
  docstrings embeds held-out everyday sentences worse than docstring sentences, and this corpus closes that gap.

A document is one source file or one distribution's description, and train/validation splits are by document, so
held-out text never shares a file with training text. The exact text depends on the Python version and on what is
installed: studies record the corpus fingerprint (`corpus_fingerprint`).
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import sysconfig
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

CORPORA = ("stdlib", "installed", "prose")
PROSE_FILE = Path(__file__).parent / "data" / "prose.txt.gz"

# Standard-library modules whose documentation is plain English prose. Built at run time on any machine, so the
# demo and the tests need no download. The exact text depends on the Python version.
CORPUS_MODULES = (
    "abc argparse array asyncio base64 bisect bz2 calendar cmd codecs collections colorsys configparser contextlib "
    "copy csv dataclasses datetime decimal difflib dis email enum filecmp fileinput fnmatch fractions ftplib "
    "functools gettext getopt glob gzip hashlib heapq hmac html imaplib inspect io ipaddress itertools json "
    "keyword linecache locale logging lzma mailbox mimetypes numbers operator optparse os pathlib pickle pkgutil "
    "platform plistlib poplib pprint profile pstats queue quopri random re reprlib sched secrets selectors shelve "
    "shlex shutil signal smtplib socket socketserver sqlite3 ssl statistics string struct subprocess symtable "
    "tarfile tempfile textwrap threading timeit tokenize trace traceback types typing unittest urllib.parse "
    "urllib.request uuid warnings wave weakref xml.dom.minidom zipfile zipimport"
).split()

_PROSE = re.compile(r"^[A-Z][^\n]*[a-z][.!?:]?$")


def _paragraphs(doc: str) -> list[str]:
    """Prose paragraphs of a docstring: no code, no tables, at least 8 words, mostly letters."""
    out = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        if any(marker in block for marker in (">>>", "::", "    ", "\t", "|", "{", "}")):
            continue
        text = " ".join(block.split())
        words = text.split()
        letters = sum(c.isalpha() or c.isspace() for c in text) / max(1, len(text))
        if len(words) >= 8 and letters > 0.85 and _PROSE.match(text):
            out.append(text)
    return out


@functools.lru_cache(maxsize=1)
def _builtin_corpus() -> tuple[str, ...]:
    return tuple(_collect_corpus())


def builtin_corpus() -> list[str]:
    """English paragraphs from the docstrings of standard-library modules, their classes and functions.

    Deterministic for a given Python version (about 1,800 paragraphs, 240 kB on Python 3.11). Built, not downloaded.
    """
    return list(_builtin_corpus())


def _collect_corpus() -> list[str]:
    seen, paragraphs = set(), []
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module missing from this build of Python
            continue
        objects = [module] + [obj for attr, obj in sorted(vars(module).items())
                              if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                              and getattr(obj, "__module__", None) == module.__name__]
        for obj in objects:
            members = [obj] + ([m for attr, m in sorted(vars(obj).items())
                                if not attr.startswith("_") and inspect.isfunction(m)] if inspect.isclass(obj) else [])
            for member in members:
                for paragraph in _paragraphs(inspect.getdoc(member) or ""):
                    if paragraph not in seen:
                        seen.add(paragraph)
                        paragraphs.append(paragraph)
    return paragraphs


def held_out(key: str, percent: int) -> bool:
    """A stable train/validation split by the hash of a document key (the same on every machine and process)."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 100 < percent


def _source_roots() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        root = Path(paths[key])
        if all(root != r for _, r in roots):
            roots.append(("site-packages", root))
    return roots


def _source_files() -> list[tuple[str, str]]:
    """(document key, path) of every Python file to read, tests and caches skipped, in a stable order."""
    found = []
    for label, root in _source_roots():
        for dirpath, dirs, files in os.walk(root):
            here = Path(dirpath)
            dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "__pycache__", "site-packages",
                                                          "dist-packages") and not d.startswith("."))
            found += [(f"{label}/{(here / f).relative_to(root).as_posix()}", str(here / f))
                      for f in sorted(files) if f.endswith(".py")]
    return found


def _file_paragraphs(path: str) -> list[str]:
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError, OSError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                out += _paragraphs(doc)
    return out


def _installed_environment() -> list[str]:
    from importlib import metadata

    names = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]})
    return [sys.version.split()[0]] + names


def corpus_fingerprint(name: str) -> str:
    """What the corpus `name` was built from: the Python version, plus every installed distribution for
    "installed", or the shipped file for "prose" (a short hash)."""
    if name == "prose":
        return hashlib.sha1(PROSE_FILE.read_bytes()).hexdigest()[:12]
    parts = [sys.version.split()[0]] if name == "stdlib" else _installed_environment()
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def _build_installed() -> list[dict]:
    from importlib import metadata

    files = _source_files()
    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        per_file = list(pool.map(_file_paragraphs, [path for _, path in files], chunksize=64))
    seen, documents = set(), []

    def add(key, paragraphs):
        fresh = [p for p in paragraphs if p not in seen]
        seen.update(fresh)
        if fresh:
            documents.append({"document": key, "text": "\n\n".join(fresh)})

    for (key, _), paragraphs in zip(files, per_file, strict=True):
        add(key, paragraphs)
    for dist in sorted(metadata.distributions(), key=lambda d: str(d.metadata["Name"])):
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        add(f"description/{dist.metadata['Name']}", _paragraphs(str(description)))
    return documents


def _cache_dir() -> Path:
    return Path(os.environ.get("PERFORMER_HF_CACHE", Path.home() / ".cache" / "performer_hf"))


@functools.lru_cache(maxsize=2)
def corpus_documents(name: str = "installed") -> tuple[dict, ...]:
    """The documents of corpus `name` (one of `CORPORA`) as `{"document": key, "text": paragraphs}`."""
    if name == "stdlib":
        return tuple({"document": t, "text": t} for t in builtin_corpus())  # a paragraph is a document
    if name == "prose":
        lines = gzip.decompress(PROSE_FILE.read_bytes()).decode("utf-8").splitlines()
        return tuple({"document": t, "text": t} for t in lines if t.strip())
    if name != "installed":
        raise ValueError(f"corpus must be one of {CORPORA}, got {name!r}")
    cache = _cache_dir() / f"installed-corpus-{corpus_fingerprint(name)}.jsonl"
    if cache.is_file():
        try:
            return tuple(json.loads(line) for line in cache.read_text(encoding="utf-8").splitlines())
        except (ValueError, OSError):  # a damaged cache is rebuilt
            pass
    documents = _build_installed()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".corpus-", dir=cache.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d) + "\n" for d in documents)
        os.replace(tmp, cache)
    except OSError:  # a read-only home: build again next time
        pass
    return tuple(documents)


def corpus_split(name: str, percent: int = 5) -> tuple[list[str], list[str]]:
    """`(train texts, validation texts)` of corpus `name`, split by document."""
    train, valid = [], []
    for document in corpus_documents(name):
        (valid if held_out(document["document"], percent) else train).append(document["text"])
    return train, valid
