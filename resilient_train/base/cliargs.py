"""Command-line flags of every ``resilient-train`` subcommand: one line for a bad value, exit 2.

argparse prints its whole usage (twenty lines for ``run``) before the error;
here a bad flag is the one line ``PROG: error: argument --flag: why``. The
converters check a flag's value while it is parsed, so nothing starts with a
``nan`` timeout, a port past 65535 or an unresolvable host:

* :func:`number`: a finite float in a range (``nan``, ``inf`` and ``1e308`` are
  refused where a bound says so);
* :func:`integer`: an int in a range;
* :func:`port`: an int in [0, 65535];
* :func:`host`: a name or address the resolver knows (``999.1.1.1`` is not).

Used by ``resilient_train``, ``checkpointing``, ``monitors`` and ``chaos`` alike (they
all build on ``resilient_train.base``).
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
from typing import Callable, NoReturn

from resilient_train.base.configfile import MAX_SECONDS

__all__ = ["MAX_SECONDS", "OneLineParser", "check_host", "host", "integer", "number", "port"]


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (and exit 2); sub-parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message.splitlines()[0] if message else 'bad arguments'} "
                         f"(see {self.prog} --help)\n")
        sys.exit(2)


def number(*, low: float | None = None, high: float | None = None, above: float | None = None,
           what: str = "a number") -> Callable[[str], float]:
    """An argparse ``type``: a finite float with ``low <= x <= high`` and ``x > above``."""

    def convert(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if (above is not None and not x > above) or (low is not None and x < low) or (high is not None and x > high):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range ({_range(low, high, above)})")
        return x

    return convert


def integer(*, low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an int with ``low <= n <= high``."""

    def convert(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (low is not None and n < low) or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range ({_range(low, high, None)})")
        return n

    return convert


port = integer(low=0, high=65535)


def check_host(name: str, flag: str) -> str:
    """``name`` if the resolver knows it; ``ValueError`` naming ``flag`` otherwise (no traceback, no wait)."""
    if not name or "\0" in name or len(name) > 253:
        raise ValueError(f"{flag} {name!r}: not a host name or address")
    try:
        socket.getaddrinfo(name.strip("[]"), None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) and e.strerror else str(e)
        raise ValueError(f"{flag} {name!r}: not a known host or address ({why})") from None
    return name


def host(flag: str) -> Callable[[str], str]:
    """An argparse ``type`` for :func:`check_host`."""

    def convert(text: str) -> str:
        try:
            return check_host(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag} ")) from None

    return convert


def _range(low: float | None, high: float | None, above: float | None) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above:g}")
    if low is not None:
        parts.append(f">= {low:g}")
    if high is not None:
        parts.append(f"<= {high:g}")
    return ", ".join(parts) or "any"
