"""The job's secret: the namespace of its keys in the store, never derived from what ``ps`` shows.

The store has no authentication, so every key of a job lives under a prefix
derived from a token (``resilient_train.protocol.store.job_store``): whoever does not
know it writes keys nobody reads. Where the token comes from:

* one node: the agent draws a fresh one (``secrets``, 128 bits) for each
  attempt and hands it to its ranks in their environment (``RT_JOB_TOKEN``),
  which only the job's own user can read (``/proc/PID/environ``);
* many nodes, which must share it, in this order:

  1. ``--job-token-file PATH``: a file of this user that no one else can read
     (a wider mode or another owner is refused);
  2. ``RT_JOB_TOKEN`` in every node's environment (the Slurm template draws
     one, ``srun`` passes it on);
  3. ``RUN_DIR/.job-token``: the first agent of the job to start draws one and
     writes it there (``0o600``, inside the ``0o700`` run directory), the
     others read it. This needs the nodes to share the run directory, as the
     README's ``/shared/runs/...`` does; a job restarted in it keeps the token.

It used to be the SHA-256 of ``--rdzv-id`` when none was given: the id is in
every agent's ``/proc/PID/cmdline``, which any local user can read.

Node 0's agent publishes a fingerprint of the token (a SHA-256 of it, which
tells nothing about a 128-bit secret) at the store's root; another node's
agent whose token gives another fingerprint (run directories not shared, a
different ``RT_JOB_TOKEN``) stops in one line instead of waiting in an empty
namespace.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from resilient_train.base.safefiles import read_regular
from resilient_train.protocol.store import new_token

__all__ = ["FINGERPRINT_KEY", "TOKEN_FILE", "check_fingerprint", "publish_fingerprint", "read_token_file",
           "shared_token"]

TOKEN_FILE = ".job-token"
FINGERPRINT_KEY = "rt-job-token-fingerprint"  # at the store's root: outside every namespace
_MAX_BYTES = 4096
_TOKEN = re.compile(r"[A-Za-z0-9_\-+/=.]{16,512}")


def read_token_file(path: str | os.PathLike[str], what: str) -> str:
    """The token in ``path``: a regular file (not a link) of this user, unreadable by anyone else, holding
    16 to 512 token characters. ``ValueError`` naming ``what`` otherwise."""
    try:
        raw, st = read_regular(path, _MAX_BYTES, follow_links=False)
    except (OSError, ValueError) as e:
        reason = f"cannot be read: {e.strerror or e}" if isinstance(e, OSError) else str(e)
        raise ValueError(f"{what} {str(path)!r}: {reason}") from None
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what} {str(path)!r}: belongs to uid {st.st_uid}, not to this user: its owner knows "
                         "the job's secret")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ValueError(f"{what} {str(path)!r}: mode {stat.S_IMODE(st.st_mode):o} lets other users read the "
                         "job's secret (chmod 600 it)")
    token = raw.decode("utf-8", "replace").strip()
    if len(raw) > _MAX_BYTES or not _TOKEN.fullmatch(token):
        raise ValueError(f"{what} {str(path)!r}: expected one token of 16 to 512 letters, digits or -_+/=.")
    return token


def shared_token(*, token_file: str | None, environ_token: str | None, run_dir: Path) -> tuple[str, str]:
    """The token the nodes of a many-node job share, and where it came from (see the module docstring)."""
    if token_file is not None:
        return read_token_file(token_file, "--job-token-file"), "--job-token-file"
    if environ_token:
        return environ_token, "RT_JOB_TOKEN"
    path = run_dir / TOKEN_FILE
    tmp = run_dir / f"{TOKEN_FILE}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write((new_token() + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and never over an existing one: the first agent's token wins
        except FileExistsError:
            pass
    except OSError as e:
        raise ValueError(f"cannot write the job's token to {str(path)!r}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return read_token_file(path, "the job's token file"), str(path)


def _fingerprint(token: str) -> str:
    return hashlib.sha256(f"resilient-train job token:{token}".encode()).hexdigest()


def publish_fingerprint(server: dist.Store, token: str) -> None:
    """Node 0's agent, on its fresh store: how the other nodes check they hold the same token."""
    server.set(FINGERPRINT_KEY, _fingerprint(token))


def check_fingerprint(client: dist.Store, token: str, *, source: str, timeout_s: float = 60.0) -> None:
    """Another node's agent: ``ValueError`` (one line) unless node 0's agent holds the same token."""
    try:
        client.wait([FINGERPRINT_KEY], timedelta(seconds=timeout_s))
        theirs = client.get(FINGERPRINT_KEY).decode()
    except (RuntimeError, OSError) as e:  # DistStoreError: a timeout, a lost connection
        raise ValueError(f"node 0's agent published no job token fingerprint within {timeout_s:g} s: "
                         f"{str(e).splitlines()[0][:120]}") from None
    if theirs != _fingerprint(token):
        raise ValueError(f"this node's job token ({source}) is not node 0's: give every node the same "
                         "--job-token-file or RT_JOB_TOKEN, or one --run-dir they all share")
