"""The `performer-hf` command line: `main(argv) -> exit code`, one module per subcommand.

Each subcommand module defines `HELP`, `POSITIONAL` (name, help) pairs, an `Args` dataclass (turned into flags by
transformers' HfArgumentParser, so `--num-features` and `--num_features` both work) and
`run(args, **positionals) -> int`. Usage errors exit with 2, failures print one line on stderr and exit with 1;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

SUBCOMMANDS = ("convert", "finetune", "push", "env")  # each subcommand joins when it works


class CommandError(Exception):
    """A failure to report as one line, exit code 1."""

    exit_code = 1


class UsageError(CommandError):
    """Arguments that cannot work, found before any work is done: exit code 2."""

    exit_code = 2


def _load(name):
    return importlib.import_module(f"performer_hf.cli.{name}")


def build_parser() -> argparse.ArgumentParser:
    from transformers import HfArgumentParser

    parser = argparse.ArgumentParser(
        prog="performer-hf", description="Turn pretrained Hugging Face Transformers into Performers.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on failure")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=HfArgumentParser)
    for name in SUBCOMMANDS:
        module = _load(name)
        command = sub.add_parser(name, dataclass_types=[module.Args], help=module.HELP, description=module.HELP)
        for positional, help_text in getattr(module, "POSITIONAL", ()):
            command.add_argument(positional, metavar=positional.upper(), help=help_text)
        command.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # everything, imports of torch and transformers included, answers Ctrl-C with one line
        return _main(argv)
    except KeyboardInterrupt:
        print("performer-hf: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    if namespace.command is None:
        parser.print_help()
        return 2
    module = namespace._module
    try:
        args = module.Args(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(module.Args)})
    except ValueError as err:  # a value the flags' types accept but the settings do not (--max-steps 0)
        message = str(err).strip().splitlines()[0] if str(err).strip() else "invalid arguments"
        print(f"performer-hf {namespace.command}: error: {message}", file=sys.stderr)
        return 2
    positionals = {name: getattr(namespace, name) for name, _ in getattr(module, "POSITIONAL", ())}
    try:
        return module.run(args, **positionals)
    except KeyboardInterrupt:
        print(f"performer-hf {namespace.command}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ValueError, OSError, RuntimeError) as err:
        if namespace.debug:
            raise
        text = str(err).strip()
        message = text.splitlines()[0] if text else type(err).__name__
        print(f"performer-hf {namespace.command}: error: {message}", file=sys.stderr)
        return getattr(err, "exit_code", 1)
