"""The agent's warm spares: interpreters that have imported torch, each ready to become a rank.

A replacement started cold spends seconds importing torch; a spare has done
that ahead of need (resilient_train.agent.spare is its side). What a spare-born
rank inherits must be what a cold worker of that rank gets, or it computes
other bits and runs at another speed:

* **Environment.** A spare starts with its node's worker environment less
  :data:`LATE_KEYS` (the keys that name the rank, its generation and its
  files, which nothing reads at import), so torch sizes its thread pools
  from the same ``OMP_NUM_THREADS`` and reads the same ``MKL_*``, ``CUDA_*``
  and allocator settings. A spare is handed only to a rank whose environment
  matches its own on every other key (with ``--virtual-local-rank``,
  ``CUDA_VISIBLE_DEVICES`` differs per local rank: spares are then per local
  rank), and one made stale (a restart of every worker changes the store's
  namespace) is replaced.
* **Output and stdin.** At the handover the agent sends the rank's fds 0, 1
  and 2 over a unix socket (SCM_RIGHTS): the agent's stdin and the pipes of
  the rank's relay (resilient_train.agent.workerio), the same a cold worker gets;
  what the spare printed while warming is replayed into them.
* **Process.** ``sys.argv``, ``sys.orig_argv``, ``sys.path[0]``, ``__main__``
  (``__file__`` absolute, as python sets it), the cwd, signal handlers,
  resource limits and ``sys.flags`` are a cold worker's; only
  ``/proc/PID/cmdline`` still shows the spare's command line.

The pool keeps ``size`` spares, starting one at a time, so that warming
takes at most one core from the ranks, and none within
:data:`SPARE_AFTER_HANDOVER_S` of a handover, while the ranks recover.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from enum import Enum
from typing import IO, Callable

from checkpointing.stopsignals import STOP_SIGNALS, ignore_stop_signals
from resilient_train.protocol import env as E
from resilient_train.agent import fdlimit
from resilient_train.agent.entry import Entry
from resilient_train.agent.spare import BOOT, READY

__all__ = ["LATE_KEYS", "SPARE_AFTER_HANDOVER_S", "Spare", "SparePool", "SpareState", "die_with_parent", "spare_env",
           "spares_wanted"]

SPARE_AFTER_HANDOVER_S = 3.0  # started sooner, the next spare's import slowed the recovering ranks several-fold
HANDOVER_TIMEOUT_S = 10.0  # to write the handover (it fits a socket buffer: no wait unless the env is huge)
FAILURES_BEFORE_OFF = 2  # spares that died before their handover, in a row: no more (ranks start cold)
STALE_CHECK_S = 1.0

# Set at the handover: they name the rank, its generation or its files, and nothing reads them at import.
LATE_KEYS = frozenset({E.RANK, E.LOCAL_RANK, E.GROUP_RANK, "ROLE_RANK", E.RT_GENERATION, E.RT_ROLE,
                       E.RT_SPAWNED_AT, "TORCHELASTIC_ERROR_FILE", E.RT_NODE, E.RT_NODE_INCARNATION,
                       # where the store is: it moves when its host is lost (resilient_train.protocol.succession)
                       E.MASTER_ADDR, E.MASTER_PORT, E.RT_STORE_EPOCH})


def spare_env(worker_env: dict[str, str]) -> dict[str, str]:
    """What a spare for a worker with ``worker_env`` starts with: all of it but :data:`LATE_KEYS`."""
    return {k: v for k, v in worker_env.items() if k not in LATE_KEYS}


def die_with_parent() -> None:
    """In a worker or spare before its exec: it dies with the agent (PR_SET_PDEATHSIG = 1) and gets the
    open-file limit the agent was started with (resilient_train.agent.fdlimit)."""
    fdlimit.restore_in_child()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _spare_preexec() -> None:
    """A spare before its exec: :func:`die_with_parent`, and deaf to the signals that stop a job while it waits
    (Ctrl-C or a scheduler's signal to every process must not cost the job its spare); it takes a cold
    worker's dispositions back at its handover (resilient_train.agent.spare)."""
    die_with_parent()
    ignore_stop_signals()


def spares_wanted(spares: int | None, nproc_per_node: int, *, waiting: bool) -> int:
    """``--spares`` (default 1: one lost rank); a spare node still waiting: one per local rank it may take over."""
    if waiting:
        return max(nproc_per_node, spares or 0)
    return 1 if spares is None else spares


def cold_ignored_signals() -> list[str]:
    """The stop signals a cold worker would start with ignored: those the agent ignores itself (an ignored
    signal stays ignored across exec; a handled one is reset)."""
    return [signal.Signals(s).name for s in STOP_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]


class SpareState(str, Enum):
    """WARMING -> READY -> HANDED; WARMING -> HANDED (taken while warming: it reads the handover once warm);
    WARMING or READY -> GONE (it died, or the pool gave it up)."""

    WARMING = "warming"
    READY = "ready"
    HANDED = "handed"
    GONE = "gone"


_ALLOWED = {
    SpareState.WARMING: frozenset({SpareState.READY, SpareState.HANDED, SpareState.GONE}),
    SpareState.READY: frozenset({SpareState.HANDED, SpareState.GONE}),
    SpareState.HANDED: frozenset(),
    SpareState.GONE: frozenset(),
}


def _python_path0(python_argv: list[str]) -> str:
    """``sys.path[0]`` as python sets it: the script's real directory, or the cwd for ``-m``."""
    if python_argv[0] == "-m":
        return os.getcwd()
    return os.path.dirname(os.path.realpath(python_argv[0]))


class Spare:
    """One warm interpreter (resilient_train.agent.spare), started with ``env``."""

    def __init__(self, entry: Entry, script_args: list[str], env: dict[str, str]) -> None:
        python_argv = entry.python_argv
        assert python_argv is not None, "a program (--no-python) has no spare"
        self.env = env
        self.state = SpareState.WARMING
        self.failure: str | None = None  # why its handover failed
        self.announced = False  # its spare_ready event was emitted
        self._last_words = ""  # the end of its stderr, read when it is given up
        self.started_at = time.monotonic()
        self._argv = [*python_argv, *script_args]
        self._orig_argv = entry.argv(script_args)
        self._path0 = _python_path0(python_argv)
        # What it prints while warming waits in files, replayed into the rank's streams at the handover.
        self._early: tuple[IO[bytes], IO[bytes]] = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        self._ctrl, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-c", BOOT, str(child.fileno()), self._path0, *self._argv],
                stdin=subprocess.DEVNULL, stdout=self._early[0], stderr=self._early[1], env=env,
                pass_fds=(child.fileno(),), preexec_fn=_spare_preexec,
            )
        except OSError:
            self._close_files()
            raise
        finally:
            child.close()

    def _to(self, new: SpareState) -> None:
        assert new in _ALLOWED[self.state], f"spare {self.state.value} -> {new.value}"
        self.state = new

    def poll(self, timeout_s: float = 0.0) -> SpareState:
        """Notes its ready byte (within ``timeout_s``) or its death."""
        if self.state is SpareState.WARMING:
            if select.select([self._ctrl], [], [], timeout_s)[0]:
                try:
                    ready = self._ctrl.recv(1) == READY
                except OSError:
                    ready = False
                self._to(SpareState.READY if ready else SpareState.GONE)
            elif self.proc.poll() is not None:
                self._to(SpareState.GONE)
        elif self.state is SpareState.READY and self.proc.poll() is not None:
            self._to(SpareState.GONE)
        return self.state

    def hand_over(self, env: dict[str, str], fds: tuple[int, int, int]) -> bool:
        """Makes it the worker with ``env`` and fds 0, 1, 2; False if it died first (start one cold)."""
        assert self.state in (SpareState.WARMING, SpareState.READY), self.state
        assert spare_env(env) == self.env, "a spare is handed only to a rank whose environment it started with"
        spec = {"argv": self._argv, "orig_argv": self._orig_argv, "env": env, "cwd": os.getcwd(),
                "path0": self._path0, "ignored_signals": cold_ignored_signals()}
        payload = json.dumps(spec).encode()
        message = len(payload).to_bytes(4, "big") + payload
        try:
            if self.proc.poll() is not None:
                raise OSError(f"it exited with code {self.proc.returncode}")
            self._ctrl.settimeout(HANDOVER_TIMEOUT_S)
            sent = socket.send_fds(self._ctrl, [message], list(fds))
            if sent < len(message):  # not sendall(b""): that still sends, and the spare may have gone on already
                self._ctrl.sendall(message[sent:])
        except OSError as e:
            self.close()  # first: the tail is read through the file offset it shares with the spare
            self.failure = f"{e} {self.tail()}".strip()
            return False
        self._to(SpareState.HANDED)
        self._ctrl.close()
        self._close_files()
        return True

    def tail(self, lines: int = 5) -> str:
        """The last lines it printed on stderr before it was given up (a spare that died)."""
        return "\n".join(self._last_words.splitlines()[-lines:])

    def close(self) -> None:
        """Gives it up: killed unless it is a rank now (its early output stays readable until then)."""
        if self.state is not SpareState.HANDED:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if self.state is not SpareState.GONE:
                self._to(SpareState.GONE)
            try:  # read once it is dead: the agent's file shares its offset with the spare's stderr
                f = self._early[1]
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                self._last_words = f.read().decode(errors="replace").strip()
            except (OSError, ValueError):
                pass
        self._ctrl.close()
        self._close_files()

    def _close_files(self) -> None:
        for f in self._early:
            f.close()


class SparePool:
    """``size`` spares; slot ``i`` holds one started with ``env_for(i)``."""

    def __init__(self, entry: Entry, script_args: list[str], *, env_for: Callable[[int], dict[str, str]],
                 emit: Callable[..., None], size: int = 1) -> None:
        self._entry, self._args, self._env_for, self._emit = entry, script_args, env_for, emit
        self._slots: list[Spare | None] = [None] * size
        self.enabled = False  # spares are for Supervisor jobs: off until one is seen (or expected)
        self._due = 0.0  # monotonic: no spare starts before this
        self._failures = 0  # spares in a row that died before their handover
        self._checked_at = 0.0

    @property
    def size(self) -> int:
        return len(self._slots)

    def resize(self, size: int) -> None:
        for spare in self._slots[size:]:
            if spare is not None:
                spare.close()
        self._slots = self._slots[:size] + [None] * max(0, size - len(self._slots))

    def spares(self) -> list[Spare]:
        return [s for s in self._slots if s is not None]

    def enable(self) -> None:
        self.enabled = True

    def poll(self) -> None:
        """Notes spares that died or went stale, and starts the next one when it is due."""
        self.note()
        self.start_next()

    def note(self) -> None:
        """Notes spares that died or went stale (and gives them up); starts nothing."""
        now = time.monotonic()
        stale_check = now - self._checked_at >= STALE_CHECK_S
        if stale_check:
            self._checked_at = now
        for i, spare in enumerate(self._slots):
            if spare is None:
                continue
            state = spare.poll()
            self._note(spare)
            if state is SpareState.GONE:
                self._slots[i] = None
                self._failures += 1
                spare.close()
                self._emit("spare_failed", pid=spare.proc.pid, exit_code=spare.proc.returncode, stderr=spare.tail(),
                           off=self._failures >= FAILURES_BEFORE_OFF)
            elif stale_check and spare.env != self._env_for(i):
                self._slots[i] = None
                self._emit("spare_stale", pid=spare.proc.pid)
                spare.close()

    def due(self) -> bool:
        """A spare should start now: an empty slot, none warming, none within the pause after a handover."""
        return (self.enabled and self._failures < FAILURES_BEFORE_OFF and time.monotonic() >= self._due
                and any(s is None for s in self._slots)
                and not any(s is not None and s.state is SpareState.WARMING for s in self._slots))

    def start_next(self) -> Spare | None:
        """Starts one spare into the first empty slot, if :meth:`due`."""
        return self._start_next()

    def _note(self, spare: Spare) -> None:
        if spare.state is SpareState.READY and not spare.announced:
            spare.announced = True
            self._failures = 0
            self._emit("spare_ready", pid=spare.proc.pid, warm_s=round(time.monotonic() - spare.started_at, 3),
                       ready=sum(s is not None and s.state is SpareState.READY for s in self._slots), size=self.size)

    def take(self, env: dict[str, str]) -> Spare | None:
        """A spare for the worker with ``env`` (a ready one first), out of the pool; None if none fits."""
        want = spare_env(env)
        fits = [(s.state is not SpareState.READY, i) for i, s in enumerate(self._slots)
                if s is not None and s.env == want and s.poll() is not SpareState.GONE]
        if not fits:
            return None
        _, i = min(fits)
        spare, self._slots[i] = self._slots[i], None
        self._due = time.monotonic() + SPARE_AFTER_HANDOVER_S
        return spare

    def close(self) -> None:
        for spare in self.spares():
            spare.close()
        self._slots = [None] * len(self._slots)

    def _start_next(self) -> Spare | None:
        """Starts one spare into the first empty slot, if due and none is warming."""
        if not self.due():
            return None
        for i, spare in enumerate(self._slots):
            if spare is None:
                try:
                    self._slots[i] = Spare(self._entry, self._args, self._env_for(i))
                except OSError as e:
                    self._failures = FAILURES_BEFORE_OFF
                    self._emit("spare_failed", pid=None, exit_code=None, stderr=str(e), off=True)
                    return None
                return self._slots[i]
        return None
