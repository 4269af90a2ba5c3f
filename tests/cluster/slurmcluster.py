"""A real Slurm on this one machine, for tests: ``munged``, ``slurmctld`` and one ``slurmd -N NODE`` per node.

Debian's ``slurm-wlm`` (22.05 on bookworm) and ``munge``, run as root, each
daemon in the foreground as a child of the test process, everything of theirs
in one temporary directory: munge's key and socket, slurm.conf, the
controller's state, each node's spool and the logs. Ports are free ones of
this machine (the controller's and one per node: the ``multiple-slurmd``
build Debian ships lets several ``slurmd`` share a host, each with
``-N NAME``). Node names get a random tag and resolve to 127.0.0.1 through
lines this cluster adds to ``/etc/hosts`` and removes when it stops: the
agents connect to node 0 by its name, as on a real cluster (Slurm itself
reaches each ``slurmd`` at ``NodeAddr=127.0.0.1``).

Settings a test needs that a site's defaults would make slow (each named in
:meth:`SlurmCluster._conf`): a requeued job may start again 6 s after it left
(``cred_expire=5``; 120 s by default), the scheduler looks every second, a
node whose ``slurmd`` stops answering is down within seconds. Processes are
tracked by their parents (``proctrack/linuxproc``: no cgroups here), no
GRES, no accounting (``scontrol show job`` reads a job's state; finished jobs
stay for an hour).

:meth:`SlurmCluster.stop` ends what it started and only that: its jobs (by
their ids), the processes of its nodes (a job's processes carry the node's
name in ``SLURMD_NODENAME``; a ``slurmstepd`` keeps its node's log open),
then its daemons by their process ids.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["SlurmCluster", "SlurmUnavailable", "unavailable_reason"]

COMMANDS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
HOSTS = Path("/etc/hosts")
HOSTS_LOCK = Path("/tmp/.rt-test-etc-hosts.lock")  # every cluster of every test session edits /etc/hosts under it
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE"})
START_TIMEOUT_S = 60.0


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the cluster (the reason is the message)."""


def unavailable_reason() -> str | None:
    """Why no cluster can start here, or None: root is needed (the daemons run jobs as their users and write
    /etc/hosts), and Debian's slurm-wlm and munge (``.ci/run`` installs them)."""
    if os.geteuid() != 0:
        return "the Slurm cluster needs root (its daemons, and node names in /etc/hosts)"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"no {', '.join(missing)}: install Debian's slurm-wlm and munge (.ci/run does, as root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's name and parent, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1: text.rindex(")")]
    return name, int(text[text.rindex(")") + 2:].split()[1])


def _open_files(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return out


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


class SlurmCluster:
    """``nodes`` Slurm nodes on this machine, one partition with all of them; :meth:`start`, then :meth:`stop`."""

    def __init__(self, *, nodes: int = 3, cpus: int = 2, slurmd_timeout_s: int = 5) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise SlurmUnavailable(reason)
        self.tag = secrets.token_hex(2)
        self.nodes = [f"rt{self.tag}n{i}" for i in range(nodes)]
        self.cpus, self.slurmd_timeout_s = cpus, slurmd_timeout_s
        # Not under pytest's temporary root: munged wants every directory above its socket open to all.
        self.root = Path(tempfile.mkdtemp(prefix=f"rt-slurm-{self.tag}-"))
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        # A test session run inside a Slurm job (or a shell that had one) must not hand its SLURM_* on.
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_CONF": str(self.conf)}
        self.ctld_port = _free_port()
        self.node_ports = {name: _free_port() for name in self.nodes}
        self._munged: subprocess.Popen | None = None
        self._ctld: subprocess.Popen | None = None
        self._slurmd: dict[str, subprocess.Popen] = {}
        self._jobs: list[str] = []
        self._hosts_line = f"127.0.0.1 {' '.join(self.nodes)}  # resilient-train test Slurm {self.tag}\n"

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "SlurmCluster":
        try:
            self._start_munge()
            self._write_conf()
            self._add_hosts()
            self._ctld = self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._wait(lambda: "UP" in self._run("scontrol", "ping", check=False).stdout, "slurmctld answers ping")
            for name in self.nodes:
                self.start_node(name, wait=False)
            self._wait(lambda: self.idle_nodes() == set(self.nodes), "every node idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel this cluster's jobs, kill what is left of their steps, stop the daemons; undo /etc/hosts."""
        if self._ctld is not None and self._ctld.poll() is None and self._jobs:
            self._run("scancel", *self._jobs, check=False)
        for name in self.nodes:
            self.kill_node(name)
        for proc in (self._ctld, self._munged):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._ctld = self._munged = None
        self._remove_hosts()
        shutil.rmtree(self.root, ignore_errors=True)

    def _start_munge(self) -> None:
        secret = self.root / "munge"
        secret.mkdir(mode=0o700)
        key = secret / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        run = self.root / "run"
        run.mkdir(mode=0o755)
        self.munge_socket = run / "munge.socket"
        self._munged = self._daemon("munged", [
            "munged", "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
            f"--pid-file={run / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
            f"--seed-file={secret / 'munged.seed'}"])
        self._wait(lambda: subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True)
                   .returncode == 0, "munged answers")

    def _conf(self) -> list[str]:
        host = socket.gethostname().split(".")[0]  # slurmctld checks that it runs on SlurmctldHost
        r = self.root
        lines = [
            "ClusterName=rttest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: how long a requeued job waits before it may start again (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",  # no cgroups here
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # a requeued job starts within a second of being eligible
            "SelectType=select/linear",
            "SlurmdParameters=config_overrides",  # a node is what this file says, whatever the machine has
            "ReturnToService=2",  # a node that was down is back as soon as its slurmd registers again
            f"SlurmdTimeout={self.slurmd_timeout_s}",  # a node whose slurmd is gone is down within seconds
            "MessageTimeout=5",
            "KillWait=60",  # from a cancel's SIGTERM to its SIGKILL: the agents' preemption grace (Slurm's default: 30)
            "MinJobAge=3600",  # finished jobs stay in scontrol show job
            "InactiveLimit=0",
        ]
        lines += [f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.node_ports[n]} "
                  f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN" for n in self.nodes]
        lines.append(f"PartitionName=rt Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        return lines

    def _write_conf(self) -> None:
        for d in ("state", "spool", *(f"spool/{n}" for n in self.nodes)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join(self._conf()) + "\n")

    def _daemon(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.root / f"{name}.out", "ab")
        try:
            return subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            out.close()

    # ------------------------------------------------------------ /etc/hosts
    def _edit_hosts(self, edit: Callable[[list[str]], list[str]]) -> None:
        with open(HOSTS_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with open(HOSTS, "r+") as f:  # in place: /etc/hosts may be a mount point that cannot be replaced
                lines = f.readlines()
                kept = edit(lines)
                if kept != lines:
                    f.seek(0)
                    f.truncate()
                    f.writelines(kept)

    def _add_hosts(self) -> None:
        def add(lines: list[str]) -> list[str]:
            if lines and not lines[-1].endswith("\n"):
                lines[-1] += "\n"
            return [*lines, self._hosts_line]

        self._edit_hosts(add)
        self._hosts_added = True

    def _remove_hosts(self) -> None:
        if getattr(self, "_hosts_added", False):
            self._edit_hosts(lambda lines: [line for line in lines if line != self._hosts_line])
            self._hosts_added = False

    # ------------------------------------------------------------ nodes
    def start_node(self, name: str, *, wait: bool = True) -> None:
        """Start node ``name``'s slurmd (again); with ``wait``, until Slurm has it idle."""
        assert name in self.nodes and (name not in self._slurmd or self._slurmd[name].poll() is not None)
        self._slurmd[name] = self._daemon(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        if wait:
            self._wait(lambda: name in self.idle_nodes(), f"node {name} idle")

    def idle_nodes(self) -> set[str]:
        out = self._run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout
        return {n for n, state in (line.split()[:2] for line in out.splitlines() if line.strip()) if state == "idle"}

    def node_processes(self, name: str, *, daemons: bool = True) -> set[int]:
        """Every process of node ``name``: its job steps' tasks and what they started (they carry
        ``SLURMD_NODENAME``); with ``daemons``, its slurmd and its ``slurmstepd`` processes too (their
        environment is Slurm's own, but they keep their node's slurmd log open)."""
        out: set[int] = set()
        proc = self._slurmd.get(name)
        if daemons and proc is not None and proc.poll() is None:
            out.add(proc.pid)
        log = str(self.root / f"slurmd-{name}.log")
        for pid in _pids():
            if pid == os.getpid():
                continue
            if _environ(pid).get("SLURMD_NODENAME") == name:
                out.add(pid)
            elif daemons and (_stat(pid) or ("", 0))[0] == "slurmstepd" and log in _open_files(pid):
                out.add(pid)
        return out

    def job_processes(self, job: str) -> set[int]:
        """The live processes of ``job`` on this cluster's nodes: its batch script, its steps' tasks, and what
        they started."""
        out = set()
        for pid in _pids():
            env = _environ(pid)
            if env.get("SLURM_JOB_ID") == job and env.get("SLURMD_NODENAME") in self.nodes and not _gone(pid):
                out.add(pid)
        return out

    def wait_job_gone(self, job: str, *, timeout: float) -> None:
        """Until no process of ``job`` is left: then nothing of it can act on the job any more."""
        deadline = time.monotonic() + timeout
        while left := self.job_processes(job):
            assert time.monotonic() < deadline, f"job {job}: processes {sorted(left)} left after {timeout} s"
            time.sleep(0.2)

    def kill_node(self, name: str, *, daemons: bool = True, timeout: float = 20.0) -> set[int]:
        """SIGKILL every process of node ``name`` at once, as when its host dies, until none is left; the pids.
        ``daemons=False``: the job's processes only; Slurm's (``slurmd``, ``slurmstepd``) live on."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while alive := {pid for pid in self.node_processes(name, daemons=daemons) if not _gone(pid)}:
            assert time.monotonic() < deadline, f"processes of node {name} outlive SIGKILL: {sorted(alive)}"
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed |= alive
            time.sleep(0.05)  # a process it was starting may appear: look again
        proc = self._slurmd.pop(name, None) if daemons else None
        if proc is not None:
            proc.wait(timeout=timeout)
        return killed

    # ------------------------------------------------------------ jobs
    def sbatch(self, script: Path | str, *args: str, options: Iterable[str] = (), env: dict[str, str] | None = None,
               cwd: Path | None = None) -> str:
        """Submit ``script`` with sbatch ``options`` (they win over its #SBATCH lines) and ``args``; the job id."""
        p = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], capture_output=True, text=True,
                           env={**self.env, **(env or {})}, cwd=cwd, timeout=60)
        assert p.returncode == 0, f"sbatch failed: {p.stderr}"
        job = p.stdout.strip().split(";")[0]
        self._jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (values without spaces only: JobState, Restarts, ExitCode, NodeList)."""
        out = self._run("scontrol", "--oneliner", "show", "job", job).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job: str, predicate: Callable[[dict[str, str]], bool], *, timeout: float,
                 what: str = "the state") -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job)
            if predicate(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job}: no {what} in {timeout} s; last: JobState={fields.get('JobState')} "
                                     f"Restarts={fields.get('Restarts')} ExitCode={fields.get('ExitCode')}")
            time.sleep(0.2)

    def wait_ended(self, job: str, *, timeout: float) -> dict[str, str]:
        return self.wait_job(job, lambda f: f.get("JobState") in ENDED, timeout=timeout, what="end")

    def scancel(self, job: str, *options: str) -> None:
        self._run("scancel", *options, job)

    # ------------------------------------------------------------ helpers
    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=60)
        assert not check or p.returncode == 0, f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}"
        return p

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in (("munged", self._munged), ("slurmctld", self._ctld), *self._slurmd.items()):
                if proc is not None and proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited ({proc.returncode}) before {what}: {self.log(name)}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"no {what} within {timeout} s: {self.log('slurmctld')}")
            time.sleep(0.1)

    def log(self, name: str, tail: int = 3000) -> str:
        """The end of a daemon's log and console output (``slurmctld``, ``slurmd-NODE``, ``munged``)."""
        parts = []
        for path in (self.root / f"{name}.log", self.root / f"{name}.out"):
            if path.exists():
                parts.append(path.read_text(errors="replace")[-tail:])
        return "\n".join(parts)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True
