"""Running the real CLI on bad input: one line on stderr, exit 2, and no process left behind.

The command runs in a session of its own; once it has exited, any process still
in that session (a worker, a spare, a writer it started) is a leftover. Such
leftovers are killed, so a failing test leaves nothing behind either.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What a forger or a careless operator writes where a number belongs (issue 26): each must be refused.
BAD_NUMBERS = (1e308, float("inf"), float("nan"), -1, 2**70)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    leftovers: list[int] = field(default_factory=list)


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[4]) == sid:
            out.append(int(name))
    return out


def run_isolated(argv: list[str], *, timeout: float = 120, input: str | None = None,
                 env: dict[str, str] | None = None, cwd: Path = REPO) -> Result:
    p = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        stdout, stderr = p.communicate(input, timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    left = session_members(p.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Result(p.returncode, stdout, stderr, left)


def cli(*args: str, **kw) -> Result:
    return run_isolated([sys.executable, "-m", "resilient_train.cli", *args], **kw)


def assert_one_line_exit_2(r: Result, *needles: str) -> str:
    """The whole contract for bad input; returns the line."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    for n in needles:
        assert n in lines[0], lines[0]
    assert not r.leftovers, f"processes left behind: {r.leftovers}"
    return lines[0]


def namespace_tool() -> str | None:
    """``unshare`` when this machine lets a user make a private mount namespace (for tmpfs mounts)."""
    tool = shutil.which("unshare")
    if tool is None:
        return None
    probe = subprocess.run([tool, "--user", "--map-root-user", "--mount", "true"], capture_output=True, timeout=30)
    return tool if probe.returncode == 0 else None


def in_private_mount(setup: str, argv: list[str], **kw) -> Result:
    """Runs ``argv`` in a new user and mount namespace after the shell commands ``setup`` (e.g. mounting a
    small tmpfs): the mounts vanish with the namespace, the host is never touched."""
    tool = namespace_tool()
    assert tool is not None
    script = f'{setup} && exec "$@"'
    return run_isolated([tool, "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *argv], **kw)
