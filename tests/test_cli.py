"""The command line, in-process and once as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

from attnkit.cli import main


def test_demo_prints_seed_numbers(capsys):
    assert main(["demo", "--no-gpt"]) == 0
    out = capsys.readouterr().out
    assert "0.3990 0.3854 0.8610" in out  # "shiny"
    assert "-0.4519" in out and "0.3190" in out  # CausalAttention, MultiHeadAttention (book)


def test_unknown_command_exits_2_with_one_line(capsys):
    assert main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit: error:") and err.count("\n") == 1


def test_help_and_version_as_subprocess():
    r = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "demo" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "--version"], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith("attnkit ")


def test_every_option_states_its_default_once():
    # hand-written defaults once sat beside argparse's "(default: None)"
    import argparse

    from attnkit.cli import SUBCOMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in SUBCOMMANDS:
        command = sub.choices[name]
        formatter = command.formatter_class(prog=command.prog)
        for action in command._actions:
            text = formatter._expand_help(action) if action.help else ""
            assert text.count("(default") <= 1, (name, action.dest, text)
            assert "(default: None)" not in text and "(default: False)" not in text, text
        help_text = " ".join(command.format_help().split())
        assert "(default: None)" not in help_text and "(default: )" not in help_text, name
