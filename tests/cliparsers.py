"""Every (sub)command's argparse parser of ``resilient-train``, as each subcommand's ``main`` builds it.

Shared by the flag tests (every flag has bad values) and the doc tests (every documented flag exists).
"""

from __future__ import annotations

import argparse

import pytest

from resilient_train.base.cliargs import OneLineParser
from resilient_train.cli import main

__all__ = ["SUBCOMMANDS", "parsers"]

SUBCOMMANDS = ("run", "ckpt", "status", "straggler", "dashboard", "chaos")


class _Captured(Exception):
    pass


def parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command's parser by its path (``("run",)``, ``("ckpt", "diff")``); all are OneLineParser."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[path] = p
        for a in subs:
            for name, sp in a.choices.items():
                walk(sp, path + (name,))

    original = OneLineParser.parse_args

    def grab(self: OneLineParser, *args: object, **kw: object) -> None:
        raise _Captured(self)

    OneLineParser.parse_args = grab  # type: ignore[method-assign]
    try:
        for cmd in SUBCOMMANDS:  # "run" first: the top-level parser (run, demo, placeholders for the rest)
            with pytest.raises(_Captured) as got:
                main([cmd])
            walk(got.value.args[0], () if cmd == "run" else (cmd,))
    finally:
        OneLineParser.parse_args = original  # type: ignore[method-assign]
    return found
