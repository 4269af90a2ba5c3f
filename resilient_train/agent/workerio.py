"""The workers' output: the console, torchrun's log files, and the tracebacks seen.

Every worker's stderr passes through the agent (its stdout when a flag asks
for it, or when the agent's own stdout is a pipe that may close:
resilient_train.agent.console), so that:

* a traceback printed by several ranks, or by every attempt of a script that
  fails the same way each time, is shown once; the repeats are one line naming
  the rank and attempt that showed it first;
* the last exception a worker printed (or wrote to its
  ``TORCHELASTIC_ERROR_FILE``, as torchrun's ``@record`` does) is known to the
  agent, which names the first failure as the cause and stops a job that keeps
  failing the same way;
* torchrun's ``--log-dir``, ``--redirects``, ``--tee`` and
  ``--local-ranks-filter`` work as they do there;
* what a worker writes reaches the console as it writes it: its stdout as
  read, its stderr a line at a time, and a progress bar's ``\r`` redraws at
  once (resilient_train.agent.outcut); the agent holds at most ``LINE_BOUND`` bytes
  of a line without an end;
* a console stream whose reader went (``| head``) is not the worker's
  problem: what it would have shown goes to the worker's log file instead.

Log files go to ``LOG_DIR/attempt_N/LOCAL_RANK/{stdout,stderr}.log`` and
``error.json`` (LOG_DIR defaults to ``RUN_DIR/logs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from resilient_train.agent.console import Console, Std, strip_rank_prefix
from resilient_train.agent.nativelog import NativeLogFolder
from resilient_train.agent.outcut import LineCutter, Prefixer

__all__ = ["Console", "OutputConfig", "Std", "WorkerOutput", "parse_std_streams", "read_error_file"]

_TRACEBACK = b"Traceback (most recent call last):"
# Python's words between the tracebacks of a chain of exceptions: the chain is one traceback to show.
_CHAINED = (b"During handling of the above exception", b"The above exception was the direct cause")
CHAIN_WAIT_S = 0.3  # how long a traceback's last line waits for a chained exception before it is shown
DRAIN_S = 2.0  # how long a dead worker's last output may take to arrive
READ_SIZE = 64 * 1024  # one read of a worker's pipe (a pipe holds 64 KiB)


def parse_std_streams(value: str, nproc: int, flag: str) -> dict[int, Std]:
    """torchrun's ``--redirects``/``--tee`` syntax: ``3`` for every local rank, or ``0:1,1:2`` per rank."""
    value = value.strip()

    def std(v: str) -> Std:
        n = int(v)
        if not 0 <= n <= 3:
            raise ValueError(n)
        return Std(n)

    try:
        if ":" not in value:
            chosen = std(value or "0")
            return {r: chosen for r in range(nproc)}
        out = {r: Std.NONE for r in range(nproc)}
        for item in value.split(","):
            rank, _, v = item.partition(":")
            r = int(rank)
            if not 0 <= r < nproc:
                raise ValueError(f"{flag}: local rank {r} is not in [0, {nproc})")
            out[r] = std(v)
        return out
    except ValueError as e:
        if str(e).startswith(flag):
            raise
        raise ValueError(f"{flag} {value!r}: expected 0-3, or LOCAL_RANK:0-3,... as torchrun") from None


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    log_dir: str | None = None  # default: RUN_DIR/logs
    redirects: dict[int, Std] = field(default_factory=dict)  # to files only
    tee: dict[int, Std] = field(default_factory=dict)  # to files and the console
    role: str = "default"  # the console prefix under --tee (AgentConfig.role sets it)
    local_ranks_filter: frozenset[int] | None = None  # None: every local rank on the console

    def to_file(self, local_rank: int) -> Std:
        return self.redirects.get(local_rank, Std.NONE) | self.tee.get(local_rank, Std.NONE)

    def on_console(self, local_rank: int) -> Std:
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return Std.NONE
        return Std.ALL & ~self.redirects.get(local_rank, Std.NONE)

    @property
    def prefixed(self) -> bool:
        """torchrun prefixes console lines with ``[role+local rank]:`` under --tee and --local-ranks-filter."""
        return any(self.tee.values()) or self.local_ranks_filter is not None


class WorkerOutput:
    """One worker's pipes: what goes to the console and to files, and the last exception it printed."""

    def __init__(self, *, rank: int, local_rank: int, attempt: int, config: OutputConfig, console: Console,
                 log_dir: Path) -> None:
        self.rank, self.local_rank, self.attempt = rank, local_rank, attempt
        self._console = console
        self._show = config.on_console(local_rank)
        self._file = config.to_file(local_rank)
        self._prefix = f"[{config.role}{local_rank}]:".encode() if config.prefixed else b""
        self.dir = log_dir / f"attempt_{attempt}" / str(local_rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.error_file = self.dir / "error.json"
        self.error_file.unlink(missing_ok=True)  # a replacement's file is its own
        self.last_exception: str | None = None
        self._threads: list[threading.Thread] = []
        self._pipe_out = bool(self._file & Std.OUT) or not (self._show & Std.OUT) or console.relays_stdout
        self._child: tuple[int, int, int] | None = None  # the worker's fds 0, 1, 2 (child_fds)
        self._reads: dict[Std, int] = {}  # the agent's ends of the pipes, until start()
        self._extra: list[int] = []  # fds the agent opened for the worker: closed once it holds them

    def popen_kwargs(self) -> dict[str, Any]:
        """Popen's streams for a cold worker: stdin and (unless it is read) stdout are the agent's, as under torchrun."""
        stdin, out, err = self.child_fds()
        return {"stdin": stdin, "stdout": out, "stderr": err}

    def child_fds(self) -> tuple[int, int, int]:
        """The worker's fds 0, 1 and 2: the agent's stdin, then the write ends of its pipes (stdout: the
        agent's own where nothing reads it). A warm spare that becomes this worker gets these same fds
        (resilient_train.agent.spares), so it writes where a cold worker would."""
        if self._child is None:
            stdin = _own_or_null(0, os.O_RDONLY, self._extra)
            out = _own_or_null(1, os.O_WRONLY, self._extra)
            if self._pipe_out:
                r, out = os.pipe()
                self._reads[Std.OUT] = r
                self._extra.append(out)
            r, err = os.pipe()
            self._reads[Std.ERR] = r
            self._extra.append(err)
            self._child = (stdin, out, err)
        return self._child

    def start(self, proc: subprocess.Popen | None = None) -> None:
        """The worker holds its ends now: the agent closes its copies and relays what comes."""
        self.child_fds()
        for fd in self._extra:
            os.close(fd)
        self._extra.clear()
        for std, name in ((Std.ERR, "stderr.log"), (Std.OUT, "stdout.log")):
            if std not in self._reads:
                continue
            sink = _Sink(self._console, std, show=bool(self._show & std), path=self.dir / name,
                         tee=bool(self._file & std))
            relay = self._relay_err if std is Std.ERR else self._relay_out
            t = threading.Thread(target=relay, args=(self._reads.pop(std), sink), daemon=True,
                                 name=f"rt-out-rank{self.rank}-{name}")
            t.start()
            self._threads.append(t)

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Waits for the output of a worker that exited (a grandchild holding the pipe may keep it open)."""
        for t in self._threads:
            t.join(timeout=timeout_s)

    def failure_summary(self) -> str | None:
        """The worker's error: its error file's message (torchrun's ``@record``), else the last exception printed."""
        return read_error_file(self.error_file) or self.last_exception

    def _relay_out(self, fd: int, sink: "_Sink") -> None:
        """stdout: passed on as it is read (a line's start is not held for its end), prefixed under --tee."""
        prefixed = Prefixer(self._prefix)
        try:
            while chunk := os.read(fd, READ_SIZE):
                sink.read(chunk)
                sink.show(prefixed(chunk), chunk)
        except OSError:
            pass
        finally:
            sink.close()
            os.close(fd)

    def _relay_err(self, fd: int, sink: "_Sink") -> None:
        """stderr: line by line, for its tracebacks and C++ log blocks; a bar's redraw, or a piece of a line
        past the bound, as it comes (resilient_train.agent.outcut)."""
        prefix = self._prefix
        prefixed = Prefixer(prefix)

        def raw(block: list[bytes]) -> None:
            sink.show(b"".join(prefix + line for line in block), b"".join(block))

        def traceback(block: list[bytes]) -> None:
            if not (sink.showing and self._console.traceback(block, prefix, rank=self.rank, attempt=self.attempt)):
                sink.keep(b"".join(block))

        tb = _TracebackBlock(on_exception=self._noted, show=traceback, show_raw=raw)
        native = NativeLogFolder()  # c10d's warnings: one line each, without their C++ stacks
        cutter = LineCutter()
        try:
            while chunk := os.read(fd, READ_SIZE):
                sink.read(chunk)
                for line, whole in cutter.feed(chunk):
                    if not whole:
                        tb.flush()  # a traceback gathered so far goes first
                        sink.show(prefixed(line), line)
                        continue
                    folded = native.feed(line)
                    if folded is not None:
                        if folded:
                            raw(folded)
                        continue
                    if not tb.feed(line, strip_rank_prefix(line)):
                        sink.show(prefix + line, line)
        except OSError:
            pass
        finally:
            tb.flush()
            rest = cutter.close()  # a last line without its end
            if rest:
                sink.show(prefixed(rest), rest)
            sink.close()
            os.close(fd)

    def _noted(self, bare: bytes) -> None:
        self.last_exception = bare.decode(errors="replace").strip()


class _Sink:
    """Where one stream of a worker goes: its log file under --tee/-r (every byte as read), the console,
    and, once the console's stream has closed, the log file instead (what the console would have shown)."""

    def __init__(self, console: Console, std: Std, *, show: bool, path: Path, tee: bool) -> None:
        self._console, self._std, self._path = console, std, path
        self._shown = show  # on the console at the start: kept in the log file once the console closed
        self.showing = show and not console.is_closed(std)
        self._tee = path.open("ab") if tee else None
        self._kept: IO[bytes] | None = None
        self._lock = threading.Lock()  # a traceback is shown from a timer thread too

    def read(self, chunk: bytes) -> None:
        if self._tee is not None:
            self._tee.write(chunk)
            self._tee.flush()

    def show(self, data: bytes, raw: bytes) -> None:
        if self.showing:
            if self._console.write(data, self._std):
                return
            self.showing = False
        self.keep(raw)

    def keep(self, raw: bytes) -> None:
        """The console cannot take ``raw``: the log file does, unless the stream was never shown or --tee
        logged it already."""
        if not self._shown or self._tee is not None:
            return
        with self._lock:
            if self._kept is None:
                self._kept = self._path.open("ab")
            self._kept.write(raw)
            self._kept.flush()

    def close(self) -> None:
        for f in (self._tee, self._kept):
            if f is not None:
                f.close()


class _TracebackBlock:
    """Gathers a worker's traceback, a chain of exceptions included, so the console shows it as one.

    A traceback ends at its exception line; it is held a moment (``CHAIN_WAIT_S``)
    in case Python goes on with "During handling of the above exception" and the
    next traceback of the chain, then shown, by whichever comes first: the next
    line or the timer (a worker that prints a traceback and lives on).
    """

    def __init__(self, *, on_exception: Callable[[bytes], None], show: Callable[[list[bytes]], None],
                 show_raw: Callable[[list[bytes]], None]) -> None:
        self._on_exception, self._show, self._show_raw = on_exception, show, show_raw
        self._lock = threading.Lock()
        self.lines: list[bytes] = []
        self._ended = False  # the exception line came: held for a chain
        self._timer: threading.Timer | None = None

    def feed(self, line: bytes, bare: bytes) -> bool:
        """Takes ``line`` if it belongs to a traceback; False: the caller shows it."""
        with self._lock:
            if self._ended:
                if not bare.strip() or bare.startswith(_CHAINED):
                    if bare.startswith(_CHAINED):
                        self._ended = False
                        self._cancel()
                    self.lines.append(line)
                    return True
                self._flush()
            if bare.startswith(_TRACEBACK):
                chained = any(strip_rank_prefix(x).startswith(_CHAINED) for x in self.lines[-3:])
                if self.lines and not chained:
                    self._show_raw(self.lines)  # one cut short: as it came
                    self.lines = []
                self.lines.append(line)
                return True
            if not self.lines:
                return False
            self.lines.append(line)
            if bare[:1] not in (b" ", b"\t") and bare.strip() and not bare.startswith(_CHAINED):
                self._on_exception(bare)
                self._ended = True
                self._timer = threading.Timer(CHAIN_WAIT_S, self._expire)
                self._timer.daemon = True
                self._timer.start()
            return True

    def flush(self) -> None:
        """Shows what is gathered: as a traceback if it ended, else as it came (cut short)."""
        with self._lock:
            if self._ended:
                self._flush()
            elif self.lines:
                self._show_raw(self.lines)  # cut short (the pipe closed mid-traceback): as it came
                self.lines = []

    def _expire(self) -> None:
        with self._lock:
            if self._ended:
                self._flush()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _flush(self) -> None:
        self._cancel()
        block, self.lines, self._ended = self.lines, [], False
        while block and not strip_rank_prefix(block[-1]).strip():
            block.pop()  # the blank lines held for a chain that did not come
        self._show(block)


def _own_or_null(fd: int, flags: int, opened: list[int]) -> int:
    """The agent's own ``fd`` (a worker inherits it), or /dev/null where the agent has none open."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        null = os.open(os.devnull, flags | os.O_CLOEXEC)
        opened.append(null)
        return null


def read_error_file(path: Path) -> str | None:
    """The message of torchrun's error file (``torch.distributed.elastic.multiprocessing.errors``), if any."""
    try:
        data = json.loads(path.read_text())
        message = data["message"]
        if isinstance(message, dict):
            message = message.get("message")
        return str(message).strip().splitlines()[-1] if message else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
