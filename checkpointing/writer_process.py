"""The persistent background writer: one process per rank, started once, reused by every save.

It is a plain ``python -c`` child speaking JSON
lines over its stdin/stdout, so it neither re-imports the training script (as
multiprocessing's spawn would) nor unpickles anything. Once per buffer layout it
maps the rank's staging buffers (memfds, through ``/proc/<pid>/fd``); for each
save it writes the rank's shard with DCP, fsyncs, checksums the files and
answers with their sizes and digests. If it dies, the save in flight fails and
the next save starts a fresh writer.

The writer dies with its rank (``PR_SET_PDEATHSIG``), which Linux ties to the
*thread* that forked it: a writer forked by a thread that then ends (a save
called from a short-lived thread) is SIGKILLed mid-write. So it is forked by a
thread of its own that lives as long as the ``WriterProcess``.

It ignores the signals that ask a job to stop (checkpointing.stopsignals): Ctrl-C,
``timeout``, ``kill -TERM -PGID`` and Slurm's ``--signal`` reach every process
of the job, this one too, and its rank's stop is exactly when its write must
finish (a preemption's checkpoint). It ends when its rank says so, or with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from checkpointing.errors import storage_error
from checkpointing.stopsignals import ignore_stop_signals
from checkpointing.shards import Chunk

__all__ = ["WriterDied", "WriterProcess"]


class WriterDied(RuntimeError):
    """The writer process exited while a save was in flight."""


class WriterProcess:
    def __init__(self, *, rank: int) -> None:
        self._rank = rank
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._sent_version = -1
        self.starts = 0
        self._forker: ThreadPoolExecutor | None = None  # its one thread forks the writer (see the module's doc)

    def start(self) -> None:
        """Starts the process without waiting for its imports: they overlap with training."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._discard()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self._forker is None:
            self._forker = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-writer-fork-r{self._rank}")
        self._proc = self._forker.submit(
            subprocess.Popen,
            [sys.executable, "-c", f"from checkpointing.writer_process import _serve; _serve({self._rank})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
            restore_signals=False,  # keep the rank's signal dispositions (an ignored SIGXFSZ gives EFBIG)
            preexec_fn=_die_with_parent,  # a writer outliving its rank could only fail to map the rank's buffers
        ).result(timeout=60)
        self._buf = b""
        self._sent_version = -1
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def write(self, *, step: int, directory: Path, layout: list[dict[str, Any]], version: int, timeout: float,
              chunks: dict[str, Chunk] | None = None) -> dict[str, Any]:
        """Writes the staged buffers as this rank's shard into ``directory``; returns ``{file: {size, sha256}}``.

        A key in ``chunks`` is a chunk of a larger tensor (a DTensor's local piece)."""
        self.start()
        try:
            if version != self._sent_version:
                self._send({"op": "map", "layout": layout})
                self._sent_version = version
            self._send({"op": "write", "step": step, "directory": str(directory),
                        "chunks": {k: c.to_json() for k, c in (chunks or {}).items()}})
            reply = self._recv(timeout)
        except TimeoutError:
            self._discard()  # a hung writer is killed; the next save starts another
            raise TimeoutError(f"checkpoint writer of rank {self._rank} did not finish step {step} in {timeout}s") from None
        except (BrokenPipeError, EOFError):
            code = self._proc.wait(10) if self._proc is not None else None
            self._discard()
            raise WriterDied(f"checkpoint writer of rank {self._rank} died (exit code {code}) writing step {step}") from None
        assert reply["step"] == step, (reply, step)
        if "error" in reply:
            raise storage_error(reply["storage"], reply["error"]) if reply.get("storage") else OSError(reply["error"])
        return reply["files"]

    def close(self, timeout: float = 30.0) -> None:
        if self._proc is not None:
            try:
                self._send({"op": "exit"})
                self._proc.wait(timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
            self._discard()
        if self._forker is not None:
            self._forker.shutdown(wait=False)  # its thread ends now: the writer it forked is gone
            self._forker = None

    def _send(self, msg: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self._proc.stdin.flush()

    def _recv(self, timeout: float) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _discard(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass
        self._proc = None


class _KillMidWrite:
    """Test hook: writes half of the first chunk, then the process SIGKILLs itself."""

    def __init__(self, stream: Any, step: int, rank: int) -> None:
        self._stream, self._step, self._rank = stream, step, rank

    def write(self, data: Any) -> int:
        from checkpointing import testhooks

        view = memoryview(data).cast("B")
        half = len(view) // 2
        self._stream.write(view[:half])
        self._stream.flush()
        testhooks.crash_point("writing", step=self._step, rank=self._rank)
        self._stream.write(view[half:])
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _die_with_parent() -> None:
    try:  # PR_SET_PDEATHSIG = 1: SIGKILL when the rank that started this writer dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
    ignore_stop_signals()


def _serve(rank: int) -> None:
    import torch

    from checkpointing import testhooks
    from checkpointing.commit import describe_files
    from checkpointing.dcp_io import write_shard
    from checkpointing.errors import FULL, storage_fault
    from checkpointing.staging import map_buffer

    torch.set_num_threads(1)
    out = sys.stdout.buffer
    buffers: dict[str, torch.Tensor] = {}
    armed = os.environ.get(testhooks.KILL_AT_ENV, "").startswith("writing")
    for line in sys.stdin.buffer:
        msg = json.loads(line)
        if msg["op"] == "exit":
            return
        if msg["op"] == "map":
            buffers = {
                e["key"]: map_buffer(e["path"], getattr(torch, e["dtype"]), e["shape"]) for e in msg["layout"]
            }
            continue
        step, directory = msg["step"], Path(msg["directory"])
        try:
            wrap = (lambda s: _KillMidWrite(s, step, rank)) if armed else None
            chunks = {k: Chunk.from_json(c) for k, c in msg.get("chunks", {}).items()}
            testhooks.slow_write(step=step, rank=rank)
            names = write_shard(directory, rank, buffers, chunks=chunks, wrap_stream=wrap)
            files = describe_files(directory, names)
            testhooks.crash_point("written", step=step, rank=rank)
            reply: dict[str, Any] = {"step": step, "files": files}
        except Exception as e:  # reported to the rank, which fails the save and goes on
            kind = storage_fault(e)
            reply = {"step": step, "error": str(e) if kind == FULL else f"{type(e).__name__}: {e}", "storage": kind}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()

