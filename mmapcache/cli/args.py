"""The command line's argument parsing: a parser whose errors are one line, and argument types that each name the
fix (``ArgumentTypeError``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import UsageError

__all__ = ["Add", "Parser", "existing_dir", "formatter", "fraction", "index_range", "parse_kwargs", "parse_range",
           "parse_shard", "positive_int", "shard"]

PROG = "mmapcache"

# Makes a subcommand's parser: add(name, help, example, description="").
Add = Callable[..., "Parser"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump), raised so ``main`` decides the exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


# --- argument types (each raises ArgumentTypeError with the fix) -------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1] (e.g. 0.1)")
    return value


def shard(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def index_range(text: str) -> tuple[int, int | None]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = (-1, 0)
    if not sep or not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard {text!r} is not I/N with 0 <= I < N; pass e.g. 0/4 for the first of four parts")
    return shard


def parse_range(text: str) -> tuple[int, int | None]:
    """``"A:B"`` (either side may be empty) -> ``(A, B or None)`` with ``0 <= A < B``."""
    a, sep, b = text.partition(":")
    try:
        start = int(a) if a.strip() else 0
        stop = int(b) if b.strip() else None
    except ValueError:
        start, stop = -1, None
    if not sep or start < 0 or (stop is not None and stop <= start):
        raise ValueError(f"indices {text!r} is not a range A:B of source indices with 0 <= A < B; pass e.g. 0:1000")
    return start, stop


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """The ``--kwargs`` JSON object as a dict (``None`` or empty: no arguments)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--kwargs is not valid JSON ({exc.msg} at column {exc.colno}); pass an object such as "
                         "'{\"root\": \"/data\", \"size\": 224}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"--kwargs must be a JSON object of keyword arguments, got a JSON {type(value).__name__}; "
                         "pass e.g. '{\"size\": 224}'")
    return value


def existing_dir(directory: str | None) -> str:
    from .. import cache_root

    directory = os.path.abspath(directory or cache_root())
    if not os.path.exists(directory):
        return directory
    if not os.path.isdir(directory):
        raise UsageError(f"{directory} is a file, not a directory of caches; pass a directory")
    return directory
