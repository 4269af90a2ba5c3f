"""What a worker runs: a script, a module (``-m``) or a program (``--no-python``), as torchrun does."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

__all__ = ["Entry", "EntryKind"]


class EntryKind(str, Enum):
    SCRIPT = "script"  # python -u SCRIPT ARGS
    MODULE = "module"  # python -u -m MODULE ARGS
    PROGRAM = "program"  # PROGRAM ARGS (--no-python)


@dataclass(frozen=True, kw_only=True)
class Entry:
    kind: EntryKind  # script, module (python -m) or program (no python)
    target: str  # the script's path, the module's name or the program

    def argv(self, args: list[str]) -> list[str]:
        if self.kind is EntryKind.PROGRAM:
            return [self.target, *args]
        if self.kind is EntryKind.MODULE:
            return [sys.executable, "-u", "-m", self.target, *args]
        return [sys.executable, "-u", self.target, *args]

    @property
    def python_argv(self) -> list[str] | None:
        """The arguments after ``python`` (what a warm spare runs); None for a program."""
        if self.kind is EntryKind.PROGRAM:
            return None
        return ["-m", self.target] if self.kind is EntryKind.MODULE else [self.target]

    def mentions_runtime(self) -> bool:
        """Whether the entry's source names resilient_train (it may report progress to the hang detector)."""
        path: str | None = self.target
        if self.kind is EntryKind.MODULE:
            try:
                spec = importlib.util.find_spec(self.target)
            except (ImportError, ValueError):
                spec = None
            path = spec.origin if spec is not None else None
        elif self.kind is EntryKind.PROGRAM:
            return False
        try:
            return path is not None and "resilient_train" in Path(path).read_text(errors="replace")
        except OSError:
            return False
