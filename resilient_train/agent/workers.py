"""This node's workers: their environment, their start (cold, or from a warm spare), their exits as events.

A worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*,
TORCHELASTIC_*) and ours (RT_*: the run directory, its generation, its role,
the job's token; GLOO_SOCKET_IFNAME, the interface this node reaches the store
over, resilient_train.agent.glooif). A replacement is handed to a warm spare when one fits
(resilient_train.agent.spares); every worker's output passes through the agent
(resilient_train.agent.workerio). :meth:`Workers.poll` reports exits in the order
they happened (pidfd exit times, resilient_train.agent.restarts.ExitClock) and acts
on none of them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator

import torch.distributed as dist

from monitors import EventLog
from resilient_train.protocol import env as E
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.events import WorkerExited
from resilient_train.agent.glooif import GLOO_SOCKET_IFNAME, gloo_interface
from resilient_train.agent.state import AgentError
from resilient_train.agent.entry import Entry
from resilient_train.agent.restarts import ExitClock, WorkerFailure
from resilient_train.agent.spares import SparePool, SpareState, die_with_parent
from resilient_train.protocol.store import Keys, read_stop
from resilient_train.agent.workerio import Console, WorkerOutput

__all__ = ["Worker", "WorkerState", "Workers", "kill_reason"]


class WorkerState(str, Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen
    generation: int
    output: WorkerOutput
    state: WorkerState = WorkerState.RUNNING
    cause: dict | None = None  # set when the agent killed it (a hang, a straggler)
    kill_at: float | None = None  # a hung rank dumping its stacks: SIGKILL at this monotonic time


def kill_reason(cause: dict) -> str:
    if cause["kind"] == "hang":
        return str(cause["reason"])  # monitors.hangverdict.Hang.describe: the evidence, how long it held, the timeout
    return "a straggler (straggler policy: replace)"


class Workers:
    """The worker table of this node (rank -> its current worker)."""

    def __init__(self, config: AgentConfig, entry: Entry, *, run_dir: Path, events: EventLog, console: Console) -> None:
        self.config, self.entry, self.run_dir = config, entry, run_dir
        self.events, self.console = events, console
        self.log_dir = Path(config.output.log_dir) if config.output.log_dir else run_dir / "logs"
        self.exits = ExitClock()
        self.table: dict[int, Worker] = {}
        # The interface its ranks' gloo sockets bind: the one this node reaches the store over (glooif).
        self.gloo_interface = gloo_interface(config.master_addr)

    # ----------------------------------------------------------- the table
    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.table.values()))

    def __len__(self) -> int:
        return len(self.table)

    def get(self, rank: int) -> Worker | None:
        return self.table.get(rank)

    def running_pids(self) -> dict[int, int]:
        return {w.rank: w.proc.pid for w in self.table.values() if w.state is WorkerState.RUNNING}

    def all_succeeded(self) -> bool:
        return bool(self.table) and all(w.state is WorkerState.SUCCEEDED for w in self.table.values())

    def procs(self) -> dict[int, subprocess.Popen]:
        return {w.rank: w.proc for w in self.table.values()}

    # ------------------------------------------------------------- the env
    @property
    def omp_default(self) -> bool:
        """torchrun's rule: OMP_NUM_THREADS=1 for several workers, unless the user set it."""
        c = self.config
        return c.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in c.env

    def env(self, rank: int, generation: int, *, replacement: bool, port: int, token: str, attempt: int,
            error_file: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        c = self.config
        local = rank - c.first_rank
        env = dict(os.environ)
        env.update(c.env)
        env.update({
            E.RANK: str(rank), E.LOCAL_RANK: str(local),
            E.WORLD_SIZE: str(c.world_size), E.LOCAL_WORLD_SIZE: str(c.nproc_per_node),
            E.GROUP_RANK: str(c.node_rank), "GROUP_WORLD_SIZE": str(c.nnodes),
            "ROLE_RANK": str(rank), "ROLE_NAME": c.role, "ROLE_WORLD_SIZE": str(c.world_size),
            E.MASTER_ADDR: c.master_addr, E.MASTER_PORT: str(port),
            E.TORCHELASTIC_USE_AGENT_STORE: "True", E.TORCHELASTIC_RESTART_COUNT: str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts), E.TORCHELASTIC_RUN_ID: c.run_id,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            E.RT_AGENT: "1", E.RT_RUN_DIR: str(self.run_dir.resolve()), E.RT_GENERATION: str(generation),
            E.RT_ROLE: "replacement" if replacement else "initial", E.RT_CHAOS: c.chaos,
            E.RT_JOB_TOKEN: token,
        })
        if c.elastic:
            env[E.RT_ELASTIC] = "1"  # WORLD_SIZE logical ranks on the live processes (resilient_train.rank.elastic)
        env.update(extra or {})
        if error_file is not None:
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file.resolve())
        if self.omp_default:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's default (announced once at start)
        if c.virtual_local_rank:
            env[E.LOCAL_RANK] = "0"
            env["CUDA_VISIBLE_DEVICES"] = str(local)
        if self.gloo_interface is not None:
            env.setdefault(GLOO_SOCKET_IFNAME, self.gloo_interface)  # the user's choice wins
        return env

    # ----------------------------------------------------------- spawning
    def spawn(self, rank: int, generation: int, *, replacement: bool, attempt: int,
              env_for: Callable[[Path | None], dict[str, str]], spares: SparePool | None) -> Worker:
        """Starts ``rank``'s worker (a replacement from a warm spare when one fits); ``env_for(error_file)``."""
        c = self.config
        output = WorkerOutput(rank=rank, local_rank=rank - c.first_rank, attempt=attempt, config=c.output,
                              console=self.console, log_dir=self.log_dir)
        env = env_for(output.error_file)
        env[E.RT_SPAWNED_AT] = repr(time.time())
        # The spare is kept for replacements, where its head start counts.
        spare = spares.take(env) if replacement and spares is not None else None
        spare_ready = spare is not None and spare.state is SpareState.READY
        proc: subprocess.Popen | None = None
        if spare is not None:
            if spare.hand_over(env, output.child_fds()):
                proc = spare.proc
            else:
                self.events.emit("spare_handover_failed", rank=rank, pid=spare.proc.pid, reason=spare.failure)
        if proc is None:
            try:
                proc = subprocess.Popen(self.entry.argv(c.script_args), env=env, preexec_fn=die_with_parent,
                                        **output.popen_kwargs())
            except OSError as e:
                raise AgentError(f"cannot start {self.entry.target!r}: {e.strerror or e}") from None
        output.start(proc)
        self.exits.watch(proc.pid)
        worker = self.table[rank] = Worker(rank=rank, proc=proc, generation=generation, output=output)
        warm = spare is not None and proc is spare.proc
        self.events.emit("worker_spawned", rank=rank, pid=proc.pid, generation=generation,
                         replacement=replacement, warm=warm, spare_ready=warm and spare_ready)
        return worker

    # ------------------------------------------------------------ polling
    def poll(self, store: dist.Store, step_of: Callable[[int], int] = lambda rank: -1) -> list[WorkerExited]:
        """The workers that exited since the last look, first to exit first; each marked done or failed.

        A failed worker's event carries what the decision needs from the store: whether its rank registered
        with the Supervisor, whether the run's final state or the job's stop is in; and the step its progress
        slot shows (``step_of``).
        """
        exited: list[tuple[Worker, int]] = []
        for w in self.table.values():
            if w.state is not WorkerState.RUNNING:
                continue
            rc = w.proc.poll()
            if rc is None:
                continue
            w.state = WorkerState.SUCCEEDED if rc == 0 else WorkerState.FAILED
            exited.append((w, rc))
        if not exited:
            return []
        # The first to exit is the cause; a survivor that aborted when its peer's connection closed follows it.
        exited.sort(key=lambda d: (self.exits.exited_at(d[0].proc.pid) or time.monotonic(), d[0].rank))
        final = store.check([Keys.FINAL])
        supervised = {w.rank: store.check([Keys.supervised(w.rank)]) for w, _ in exited}
        # A Supervisor rank that exits 0 before the run's final state is committed left its loop early: a fault.
        early = {w.rank for w, rc in exited if rc == 0 and supervised[w.rank] and not final}
        for w, _ in exited:
            if w.rank in early:
                w.state = WorkerState.FAILED
        failures = {w.rank: self.failure(w, rc) for w, rc in exited if rc != 0 or w.rank in early}
        stop = read_stop(store) if failures else None
        events = []
        for i, (w, rc) in enumerate(exited):
            followed = tuple(failures[o.rank] for o, _ in exited[i + 1:] if o.rank in failures)
            events.append(WorkerExited(
                rank=w.rank, pid=w.proc.pid, rc=rc, failure=failures.get(w.rank), followed=followed, stop=stop,
                final=final, supervised=supervised[w.rank], early=w.rank in early, step=step_of(w.rank)))
        return events

    def failure(self, w: Worker, rc: int) -> WorkerFailure:
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        if w.cause is not None:
            return WorkerFailure(rank=w.rank, how=how, kind=w.cause["kind"], summary=kill_reason(w.cause))
        if rc == 0:
            return WorkerFailure(rank=w.rank, how=how, kind="early-exit", summary="left the training loop with exit code 0 "
                           "before the job's end", at=self.exits.exited_at(w.proc.pid) or time.monotonic())
        w.output.drain()  # its last lines, the traceback among them, may still be in the pipe
        summary = w.output.failure_summary()
        kind = "signal" if rc < 0 else ("exception" if summary else "exit")
        return WorkerFailure(rank=w.rank, how=how, kind=kind, summary=summary if rc > 0 else None,
                       at=self.exits.exited_at(w.proc.pid) or time.monotonic())

    # ------------------------------------------------------------- ending
    def signal_all(self, signum: int) -> None:
        for w in self.table.values():
            if w.proc.poll() is None:
                try:
                    w.proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def stop(self, grace_s: float = 5.0) -> None:
        """The job is stopping: ranks that saw the stop key leave on their own; the rest are killed after a grace."""
        deadline = time.monotonic() + grace_s
        for w in self.table.values():
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()

    def kill_all(self) -> None:
        for w in self.table.values():
            if w.proc.poll() is None:
                w.proc.kill()
        for w in self.table.values():
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def exit_codes(self) -> dict[int, int | None]:
        return {w.rank: w.proc.returncode for w in self.table.values()}

    def close(self) -> None:
        self.kill_all()
        for w in self.table.values():
            w.output.drain(timeout_s=0.5)
        self.exits.close()


