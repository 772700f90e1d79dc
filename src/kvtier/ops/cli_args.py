"""Argument types every kvtier command shares: bounded numbers, sizes, durations, plot files.

Each is an argparse ``type``: a bad value is one line naming the option and what it takes
(``argument --seed: must be an integer >= 0, got '-1'``) before anything runs. ``Parser`` reads
``--capacity -5G`` as a value (argparse alone takes only ``-5``-like numbers for values), so
that its real error is the one shown.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvtier.ops.table import parse_duration, parse_size

PLOT_INSTALL = "pip install 'kvtier[plot]'"
WRITE_POLICIES = ("write_through", "write_back")  # the engine-side index's (kvtier.engine.index)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose values may start with '-' and a digit (``-5G``, ``-1``), and
    that takes an option only by its whole name (``--user`` is not ``--users``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        """Usage, then one line in kvtier's form: ``kvtier: error: --seed: must be ...``."""
        self.print_usage(sys.stderr)
        self.exit(2, f"kvtier: error: {message.removeprefix('argument ')}\n")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows an option's default where it has one (never "(default: None)", and
    never twice: help that names its default itself is left as written)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if (
            action.default is None
            or action.default is argparse.SUPPRESS
            or not action.help
            or "(default:" in action.help
        ):
            return action.help
        return super()._get_help_string(action)


def integer(least: int | None = None, most: int | None = None) -> Callable[[str], int]:
    """An int in [least, most] (either bound optional)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if (
            value is None
            or (least is not None and value < least)
            or (most is not None and value > most)
        ):
            raise argparse.ArgumentTypeError(
                f"must be an integer {_bounds(least, most)}, got {text!r}"
            )
        return value

    parse.__name__ = "integer"
    return parse


def _bounds(least: int | None, most: int | None) -> str:
    if least is not None and most is not None:
        return f"in {least}..{most}"
    if least is not None:
        return f">= {least}"
    return f"<= {most}" if most is not None else ""


def positive_number(text: str) -> float:
    """A float > 0 (seconds, rates)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def byte_size(least: int = 1) -> Callable[[str], int]:
    """A size in bytes >= ``least``: 4096, 64M, 500M, 10G, 1.5T (binary units)."""

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: a size must be >= {least}")
        return value

    parse.__name__ = "size"
    return parse


def duration(text: str) -> float:
    """Seconds: 90s, 30m, 12h, 7d, 2w or a plain number of seconds."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def plot_file(text: str) -> str:
    """A PNG path for ``--plot``; refused at once when matplotlib is not installed."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise argparse.ArgumentTypeError(
            f"needs matplotlib, which is not installed: {PLOT_INSTALL}"
        )
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):  # said now, not after the whole benchmark ran
        raise argparse.ArgumentTypeError(f"{folder} does not exist: make it first")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{folder} is not writable by you")
    return text


def comma_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """A comma-separated list of some of ``allowed`` (order kept, repeats dropped)."""

    def parse(text: str) -> list[str]:
        chosen = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
        wrong = [x for x in chosen if x not in allowed]
        if wrong or not chosen:
            given = ", ".join(map(repr, wrong)) or "nothing"
            raise argparse.ArgumentTypeError(f"{given} given: choose from {', '.join(allowed)}")
        return chosen

    return parse


SEED = integer(0, 2**32 - 1)  # what numpy's and Python's generators take
COUNT = integer(1)
SIZE = byte_size(1)


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The (sub)parser of the subcommand ``args`` chose, for its usage in an error."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, actions[0].dest, None) if actions else None
        if chosen is None or chosen not in actions[0].choices:
            return parser
        parser = actions[0].choices[chosen]
