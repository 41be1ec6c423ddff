"""`performer-hf push DIR REPO`: upload a converted or fine-tuned model directory to the Hub."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

NAME = "push"
HELP = "upload a converted or fine-tuned model directory to a Hub repository"
POSITIONAL = (
    ("dir", "the model directory (from convert or finetune)"),
    ("repo", "Hub repository id, e.g. me/bert-performer"),
)


@dataclass
class Args:
    private: bool = field(default=False, metadata={"help": "create the repository as private"})
    commit_message: str | None = field(default=None, metadata={"help": "commit message"})


def run(args: Args, dir: str, repo: str) -> int:  # noqa: A002 (the argument is named as on the command line)
    from ..conversion import performer_settings
    from ..hub import push_directory
    from . import UsageError

    directory = Path(dir)
    if not (directory / "config.json").is_file():
        raise UsageError(f"{directory} is not a model directory (no config.json)")
    from transformers import AutoConfig

    if performer_settings(AutoConfig.from_pretrained(directory, trust_remote_code=False)) is None:
        raise UsageError(f"{directory} is not a converted model (no Performer settings in config.json); "
                         f"convert it first: performer-hf convert {directory} --out DIR")
    url = push_directory(directory, repo, private=args.private, commit_message=args.commit_message)
    print(f"pushed {directory} to {repo}: {url}")
    return 0
