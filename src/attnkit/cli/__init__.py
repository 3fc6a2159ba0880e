"""The ``attnkit`` command line: thin shells over library calls, one file per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` which registers its
parser and sets ``func`` to a ``run(args) -> int``. User errors raise
:class:`CliError`: one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from attnkit import __version__

if TYPE_CHECKING:
    from attnkit.train.data import ByteTokenizer, CharTokenizer

__all__ = [
    "CliError",
    "HelpFormatter",
    "encode_prompt",
    "main",
    "new_tokens_for",
    "output_dir",
    "output_file",
    "writable_output",
]

#: Subcommand modules, in the order ``--help`` lists them.
SUBCOMMANDS = ["demo", "explain", "viz", "bench", "train", "generate", "serve"]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help with defaults shown once and descriptions/examples kept as written.

    argparse's ``(default: X)`` is added only where it says something: not to an option
    whose help already states its default (``"(default: ..."``, written so by hand where
    argparse's would say None), and not for a default of None, False or ``""`` (an option
    left out, a flag not given).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == ""
        if "(default" in text or "%(default)" in text or unset:
            return action.help
        return super()._get_help_string(action)


def output_dir(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as an output folder: refused (CliError) if it, or a parent, is a file.

    Nothing is created here; the caller creates the folder when it writes.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CliError(f"{flag} {str(p)!r} is a file, not a directory")
    _check_parents(p, flag)
    return p


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as an output file: refused (CliError) if it is a directory or under a file."""
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{flag} {str(p)!r} is a directory, not a file")
    _check_parents(p, flag)
    return p


def writable_output(
    path: str | Path, flag: str = "--out", *, folder: bool = True, keep: bool = False
) -> Path:
    """``path`` as :func:`output_dir` (``folder``) or :func:`output_file` takes it, and
    shown now to be writable: its missing folders are made and a file is created and
    removed in it (what ``mkdir`` or a write would refuse later, on ``/proc``, a
    read-only mount or another user's folder), then the folders made are removed again
    unless ``keep``, so a command refused later still leaves nothing behind. For
    commands that work seconds to minutes before they write (``attnkit bench``, ``train``,
    ``demo``, ``viz``, the benchmark modules): a :class:`CliError` naming ``flag``
    before the work, not a traceback that loses it at the end."""
    p = output_dir(path, flag) if folder else output_file(path, flag)
    where = p if folder else p.parent
    missing = [d for d in (where, *where.absolute().parents) if not d.exists()]
    made: list[Path] = []
    writable = False
    try:
        for d in reversed(missing):  # outermost first
            d.mkdir()
            made.append(d)
        with tempfile.TemporaryFile(dir=where):
            writable = True
    except OSError as err:
        what = "cannot make" if len(made) < len(missing) else "cannot write in"
        raise CliError(f"{flag} {str(p)!r}: {what} {str(where)!r} ({err.strerror})") from None
    finally:
        if not (keep and writable):
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    d.rmdir()
    return p


def _check_parents(p: Path, flag: str) -> None:
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise CliError(f"{flag} {str(p)!r}: {str(parent)!r} is a file, not a directory")
            return


def encode_prompt(
    tokenizer: CharTokenizer | ByteTokenizer, text: str, name: str = "prompt"
) -> list[int]:
    """``text``'s token ids by a checkpoint's tokenizer, for ``attnkit generate`` and
    ``attnkit serve``; a :class:`CliError` naming ``name`` where it has a character the
    vocabulary lacks or no token at all."""
    try:
        ids = tokenizer.encode(text)
    except ValueError as err:
        raise CliError(f"{name}: {err}") from None
    if not ids:
        raise CliError(f"{name} is empty")
    return ids


def new_tokens_for(meta: dict, context_length: int, prompt_length: int) -> int:
    """How many tokens ``attnkit generate`` and ``attnkit serve`` add to a prompt of a
    checkpoint when ``--max-new-tokens`` is not given: a task's answer (one token for
    ``recall``, ``length`` for the others), else the rest of the context (text); never
    past ``context_length``."""
    task = meta.get("task")
    if task:
        n = 1 if task == "recall" else int(meta.get("length") or 1)
    else:
        n = context_length - prompt_length
    return min(n, context_length - prompt_length)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own usage errors: exit 2, one line
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    parser = _Parser(
        prog="attnkit",
        description="Attention mechanisms for PyTorch.",
        epilog="Run `attnkit COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"attnkit.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 user error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except CliError as err:
        print(f"attnkit: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `attnkit demo | head`
        sys.stderr.close()
        return 0
    except OSError as err:  # a path the user named cannot be read or written
        where = f" {err.filename!r}:" if err.filename else ""
        print(f"attnkit: error:{where} {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
