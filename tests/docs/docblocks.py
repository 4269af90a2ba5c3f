"""What a user would copy out of README.md and docs/*.md, read from the Markdown: the doc tests' inventory.

* :func:`snippets`: every fenced block (with its language) and every indented
  code block; an indented block of shell commands is split into one snippet per
  command (a ``\\`` continuation joined, comments dropped), any other indented
  block (a Python fragment, a program's output) is one snippet;
* :func:`inline_spans`: every inline code span outside the blocks
  (`` `resilient-train status RUN_DIR` ``, `` `examples/train_gpt.py` ``);
* :func:`shrink`: a documented ``resilient-train`` command as the argv a test
  runs: the same flags, smaller sizes, paths under the test's directory.

A code block in a list item is indented four columns past the item's text (CommonMark); a paragraph
continuing a list item is not a code block.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DOCS", "REPO", "Snippet", "block", "documented", "inline_spans", "shrink", "snippets"]

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
# The first word of a shell command in an indented block (an environment assignment may come first).
_COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(resilient-train|python|python3|pip|sbatch|torchrun|srun)\s")
_LIST_ITEM = re.compile(r"^(\s*)(?:[*+-]|\d+[.)])\s+")


@dataclass(frozen=True)
class Snippet:
    """One thing to copy: ``kind`` is ``command`` (one shell command), ``indented`` (another indented block)
    or a fenced block's language (``python``, ``yaml``, ``diff``; ``text`` for none)."""

    file: str
    line: int
    kind: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def snippets(files: tuple[str, ...] = DOCS) -> list[Snippet]:
    out: list[Snippet] = []
    for name in files:
        out.extend(_snippets_of(name, (REPO / name).read_text().splitlines()))
    return out


def _snippets_of(name: str, lines: list[str]) -> list[Snippet]:
    out: list[Snippet] = []
    content = 0  # the text column of the list item the current paragraph belongs to (0: none)
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if stripped.startswith("```"):
            lang = stripped[3:].strip() or "text"
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            body = [text[indent:] for text in lines[i + 1:end]]
            out.append(Snippet(name, i + 2, lang, "\n".join(body) + "\n"))
            i = end + 1
            continue
        if not stripped:
            i += 1
            continue
        blank_before = i == 0 or not lines[i - 1].strip()
        if blank_before and indent >= content + 4:
            end = i
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) >= content + 4):
                end += 1
            block = [text[content + 4:] for text in lines[i:end]]
            while block and not block[-1].strip():
                block.pop()
            out.extend(_split(name, i + 1, block))
            i = end
            continue
        item = _LIST_ITEM.match(line)
        if item:
            content = len(item.group(0))
        elif indent < content:
            content = 0
        i += 1
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split(name: str, first: int, block: list[str]) -> list[Snippet]:
    """An indented block of shell commands: one snippet a command; anything else: the block."""
    code = [text for text in block if text.strip() and not text.lstrip().startswith("#")]
    if not code or not _COMMAND.match(code[0]):
        return [Snippet(name, first, "indented", "\n".join(block) + "\n")]
    out: list[Snippet] = []
    pending: list[str] = []
    start = first
    for n, text in enumerate(block):
        if not pending:
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            start = first + n
        part = _uncomment(text).rstrip()
        if part.endswith("\\"):
            pending.append(part[:-1].strip())
            continue
        pending.append(part.strip())
        out.append(Snippet(name, start, "command", " ".join(p for p in pending if p)))
        pending = []
    return out


def _uncomment(text: str) -> str:
    """A shell line without its trailing ``# comment`` (a ``#`` after white space, outside quotes)."""
    quote = None
    for n, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and n and text[n - 1].isspace():
            return text[:n]
    return text


def inline_spans(files: tuple[str, ...] = DOCS) -> list[tuple[str, int, str]]:
    """Every inline code span outside fenced and indented blocks: (file, line, text)."""
    out = []
    for name in files:
        lines = (REPO / name).read_text().splitlines()
        inside = {s.line + k for s in _snippets_of(name, lines) for k in range(-1, s.text.count("\n") + 1)}
        for n, line in enumerate(lines, 1):
            if n in inside:
                continue
            out.extend((name, n, m.group(1)) for m in re.finditer(r"`([^`]+)`", line))
    return out


def documented(kind: str, text: str) -> Snippet:
    """The snippet of ``kind`` whose text is ``text``: a test that runs a documented command names it by its
    text, so that the test fails (here) when the docs change it."""
    found = [s for s in snippets() if s.kind == kind and s.text == text]
    assert found, f"no {kind} {text!r} in {', '.join(DOCS)} any more: update the test with the docs"
    return found[0]


def block(key: str) -> Snippet:
    """The one block (not a command) that ``FILE:KIND:WORDS`` names: of ``KIND`` in ``FILE``, holding ``WORDS``
    (the form of its key in tests/docs/registry.py)."""
    file, kind, words = key.split(":", 2)
    found = [s for s in snippets((file,)) if s.kind == kind and words in s.text]
    assert len(found) == 1, f"{len(found)} {kind} blocks of {file} hold {words!r}: update the test with the docs"
    return found[0]


def shrink(command: str, tmp: Path, *, sizes: dict[str, str] | None = None, append: list[str] | None = None
           ) -> list[str]:
    """``command`` (``resilient-train ...``) as a test's argv: each flag in ``sizes`` gets the test's value
    (``--nproc-per-node 4`` -> ``2``), a ``runs/...`` path is put under ``tmp``, ``append`` goes at the end
    (the script's own size flags). No flag is added to ``resilient-train``'s own, none is dropped."""
    words = shlex.split(command)
    assert words[0] == "resilient-train", command
    sizes = dict(sizes or {})
    out = [sys.executable, "-m", "resilient_train.cli"]
    k = 1
    while k < len(words):
        word = words[k]
        flag, eq, value = word.partition("=")
        if flag in sizes and eq:
            out.append(f"{flag}={sizes.pop(flag)}")
        elif word in sizes:
            out += [word, sizes.pop(word)]
            k += 1  # its value, replaced
        elif word.startswith("runs/"):
            out.append(str(tmp / word))
        else:
            out.append(word)
        k += 1
    assert not sizes, f"{command!r} has no {sorted(sizes)}"
    return out + list(append or [])
