"""Where `fabric run`'s own options end and the script's arguments begin, by the rule of Lightning's (click) CLI.

After `run`, an option `fabric run` knows (with its value) is its own wherever it stands, before or after SCRIPT,
until a `--`; everything after `--`, every option it does not know and every word after SCRIPT goes to the script,
verbatim and in order. So a script option spelled like one of `fabric run`'s (say `--devices`) must follow `--`.
Like click, no abbreviations (`--dev` is the script's), and `-h` after SCRIPT is the script's (click knows `--help`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def _option_arity(run: argparse.ArgumentParser) -> dict[str, bool]:
    """Every option string of `run`, and whether it takes a value (`--devices 2`) or not (`--help`)."""
    return {option: action.nargs != 0 for action in run._actions for option in action.option_strings}


def split_run_argv(run: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the tokens for `run`'s parser, ending with SCRIPT; the script's arguments) from what follows `run`."""
    known = _option_arity(run)
    ours: list[str] = []
    script: list[str] = []  # SCRIPT and its arguments
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            if not script and i < len(tokens):
                script.append(tokens[i])  # `fabric run -- train.py ...`: SCRIPT may follow the `--`
                i += 1
            script.extend(tokens[i:])
            break
        name = token.split("=", 1)[0]
        if name in known and not (name == "-h" and script):
            ours.append(token)
            if known[name] and "=" not in token and i < len(tokens):
                ours.append(tokens[i])  # the value, even one starting with '-' (`--devices -1`), as click does
                i += 1
        elif token.startswith("-") and token != "-" and not script:
            ours.append(token)  # an unknown option before SCRIPT: the parser reports it
        else:
            script.append(token)
    return ours + script[:1], script[1:]
