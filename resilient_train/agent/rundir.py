"""The run directory: one job at a time, private to its owner, no links where the runtime writes.

Two jobs on one ``--run-dir`` would both resume from each other's live
checkpoints and both write ``final/``. So a job takes an exclusive ``flock`` on
``RUN_DIR/.lock`` and keeps it for its life; a second job is refused in one
line naming the holder's pid. The kernel drops the lock when the holding
process dies, however it dies: a crashed job never leaves a stale lock, and
there is nothing to clean up by hand.

Everything in a run directory steers or reveals the job (the straggler control
file, checkpoints a restart resumes from, the events), so the directory is made
private to its owner (``0o700``), one owned by another user is refused, and so
is a symbolic link at a name the runtime writes (``events.jsonl``,
``.monitors``, ``checkpoints``, ...). Files inside are created without following
links (``resilient_train.base.safefiles``).
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

__all__ = ["LOCK_FILE", "PRIVATE_MODE", "RunDirError", "RunDirLock", "lock_run_dir", "prepare_run_dir", "take_run_dir"]

LOCK_FILE = ".lock"
PRIVATE_MODE = 0o700
# The names the runtime creates at the top of a run directory.
RUNTIME_NAMES = ("events.jsonl", ".monitors", "checkpoints", "final", ".chaos", "tensorboard", LOCK_FILE)


class RunDirError(ValueError):
    """The run directory cannot be used by this job; the message is one line that says why."""


class RunDirLock:
    """This job's hold on a run directory; released by ``release()`` or when the process exits."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._file = os.fdopen(fd, "r+b", buffering=0)  # closed (and the lock dropped) if collected

    @property
    def held(self) -> bool:
        return not self._file.closed

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()


def prepare_run_dir(path: str | os.PathLike[str], *, mode: int = PRIVATE_MODE) -> Path:
    """Creates ``path`` (``mode``), checks it is this user's, tightens a wider mode to ``mode``, and refuses
    symbolic links at the runtime's names. Raises :class:`RunDirError`."""
    p = Path(path)
    try:
        p.mkdir(mode=mode, parents=True, exist_ok=True)
        st = os.stat(p)
    except OSError as e:
        raise RunDirError(f"run directory {str(p)!r} is not writable: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"run directory {str(p)!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise RunDirError(f"run directory {str(p)!r} belongs to uid {st.st_uid}, not to this user "
                          f"(uid {os.geteuid()}): its owner could read and steer the job")
    if stat.S_IMODE(st.st_mode) & ~mode:
        os.chmod(p, stat.S_IMODE(st.st_mode) & mode)
    for name in RUNTIME_NAMES:
        if (p / name).is_symlink():
            raise RunDirError(f"{str(p / name)!r} is a symbolic link; the runtime never writes through links "
                              "(remove it, or pick another --run-dir)")
    probe = p / f".write-test-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise RunDirError(f"run directory {str(p)!r} is not writable: {e.strerror or e}") from None
    return p


def lock_run_dir(path: str | os.PathLike[str], *, name: str = LOCK_FILE) -> RunDirLock:
    """Takes the job's exclusive lock on ``path`` without waiting: a held one is refused at once, naming its pid.

    The agents of a many-node job share a run directory: each node's takes its own ``name``.
    """
    p = Path(path)
    lock = p / name
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise RunDirError(f"cannot open the lock file {str(lock)!r}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        who = f"pid {holder}" if holder is not None else "a process that has not written its pid yet"
        raise RunDirError(f"run directory {str(p)!r} is in use by another job ({who}); wait for it to end "
                          "or pick another --run-dir") from None
    except OSError as e:
        os.close(fd)
        raise RunDirError(f"cannot lock {str(lock)!r}: {e.strerror or e}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunDirLock(p, fd)


def take_run_dir(path: str | os.PathLike[str], *, mode: int = PRIVATE_MODE, name: str = LOCK_FILE) -> RunDirLock:
    """``prepare_run_dir`` then ``lock_run_dir``: what a job does before anything else in its run directory."""
    return lock_run_dir(prepare_run_dir(path, mode=mode), name=name)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdecimal() else None
