"""The agent's relay of a worker's output: a chain of exceptions is one traceback on the console, a progress
bar is shown as it is drawn, a line without an end is never held whole, a console closed under the job
(``| head``) is not the job's fault.

Real worker processes print into real pipes; the console writes into a buffer the test reads, or the agent
runs whole, with a pipe the test closes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from resilient_train.agent.workerio import Console, OutputConfig, Std, WorkerOutput

# A collective fails because a peer was interrupted, then this rank's own Ctrl-C arrives while it handles that.
CHAINED = textwrap.dedent("""
    try:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:21889")
    except RuntimeError:
        raise KeyboardInterrupt
""")
LIVES_ON = textwrap.dedent("""
    import sys, time, traceback
    try:
        raise ValueError("caught and printed")
    except ValueError:
        traceback.print_exc()
    sys.stderr.flush()
    time.sleep(60)
""")


def _relay(tmp_path, code: str, console: Console) -> tuple[subprocess.Popen, WorkerOutput]:
    out = WorkerOutput(rank=0, local_rank=0, attempt=0, config=OutputConfig(), console=console, log_dir=tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", code], **out.popen_kwargs())
    out.start(proc)
    return proc, out


@pytest.mark.timeout(60)
def test_a_chained_keyboard_interrupt_after_ctrl_c_is_one_line(tmp_path):
    err = io.BytesIO()
    console = Console(out=io.BytesIO(), err=err)
    console.interrupt()
    proc, out = _relay(tmp_path, CHAINED, console)
    proc.wait(30)
    out.drain()
    assert err.getvalue().decode().splitlines() == ["[rank0]: interrupted (KeyboardInterrupt)"]
    assert out.last_exception == "KeyboardInterrupt"


@pytest.mark.timeout(60)
def test_a_chained_traceback_is_shown_whole_once(tmp_path):
    err = io.BytesIO()
    proc, out = _relay(tmp_path, CHAINED, Console(out=io.BytesIO(), err=err))
    proc.wait(30)
    out.drain()
    text = err.getvalue().decode()
    assert text.count("Traceback (most recent call last):") == 2
    assert "During handling of the above exception, another exception occurred:" in text
    assert text.index("RuntimeError: Connection closed") < text.index("During handling") < text.index(
        "KeyboardInterrupt")


@pytest.mark.timeout(60)
def test_a_traceback_of_a_worker_that_lives_on_is_shown_while_it_runs(tmp_path):
    err = io.BytesIO()
    proc, out = _relay(tmp_path, LIVES_ON, Console(out=io.BytesIO(), err=err))
    try:
        deadline = time.monotonic() + 30
        while b"ValueError: caught and printed" not in err.getvalue():
            assert time.monotonic() < deadline, err.getvalue()
            time.sleep(0.05)
        assert proc.poll() is None  # shown while the worker still runs: no chain was waited for past its end
        assert out.last_exception == "ValueError: caught and printed"
    finally:
        proc.kill()
        proc.wait(30)
        out.drain()


# ---------------------------------------------------------------- what comes as it is written, and how much is held

def _wait_for(buffer: io.BytesIO, data: bytes, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while data not in buffer.getvalue():
        assert proc.poll() is None, (proc.returncode, buffer.getvalue())
        assert time.monotonic() < deadline, buffer.getvalue()
        time.sleep(0.02)


# A tqdm-style bar: each redraw is "\r" and the bar, no newline until it closes; the worker waits between them.
BAR = textwrap.dedent("""
    import os, sys, time
    go = sys.argv[1]
    for i in range(3):
        sys.stderr.write(f"\\r{i + 1}/3 |{'#' * (i + 1)}{' ' * (2 - i)}|")
        sys.stderr.flush()
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{go}.{i}"):  # the test saw this redraw
            assert time.monotonic() < deadline
            time.sleep(0.01)
    sys.stderr.write("\\n")
    raise ValueError("after the bar")
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tee", [False, True])
def test_a_progress_bar_reaches_the_console_as_it_is_drawn(tmp_path, tee):
    err = io.BytesIO()
    config = OutputConfig(tee={0: Std.ALL}) if tee else OutputConfig()
    out = WorkerOutput(rank=0, local_rank=0, attempt=0, config=config, console=Console(out=io.BytesIO(), err=err),
                       log_dir=tmp_path)
    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", BAR, str(go)], **out.popen_kwargs())
    out.start(proc)
    p = b"[default0]:" if tee else b""
    try:
        for i in range(3):
            _wait_for(err, b"\r" + p + f"{i + 1}/3 |".encode(), proc)  # while the worker waits: as it drew it
            (tmp_path / f"go.{i}").touch()
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait(30)
        out.drain()
    text = err.getvalue()
    assert text.startswith(p + b"\r" + p + b"1/3 |#  |\r" + p + b"2/3 |## |\r" + p + b"3/3 |###|\n"), text
    assert text.count(b"Traceback (most recent call last):") == 1 and out.last_exception == "ValueError: after the bar"
    if tee:  # the log file: every byte as the worker wrote it
        assert (out.dir / "stderr.log").read_bytes().startswith(b"\r1/3 |#  |\r2/3 |## |\r3/3 |###|\n")


@pytest.mark.timeout(60)
def test_a_traceback_on_a_bars_line_is_still_a_traceback(tmp_path):
    """Python does not end a bar's line before the traceback of the exception that stopped the loop."""
    err = io.BytesIO()
    code = 'import sys\nsys.stderr.write("\\r 42%|####      |")\nsys.stderr.flush()\nraise KeyError("in the loop")'
    proc, out = _relay(tmp_path, code, Console(out=io.BytesIO(), err=err))
    proc.wait(30)
    out.drain()
    lines = err.getvalue().split(b"\n")
    assert lines[0] == b"\r 42%|####      |" and lines[1] == b"Traceback (most recent call last):", lines
    assert out.last_exception == "KeyError: 'in the loop'"


@pytest.mark.timeout(60)
def test_a_read_stdout_passes_what_comes_without_waiting_for_the_line_end(tmp_path):
    console_out = io.BytesIO()  # no file behind it: the worker's stdout is read (Console.relays_stdout)
    console = Console(out=console_out, err=io.BytesIO())
    assert console.relays_stdout
    code = ("import os, sys, time\nsys.stdout.write('loading... ')\nsys.stdout.flush()\n"
            "deadline = time.monotonic() + 30\n"
            "while not os.path.exists(sys.argv[1]):\n    assert time.monotonic() < deadline\n    time.sleep(0.01)\n"
            "print('done')")
    out = WorkerOutput(rank=0, local_rank=0, attempt=0, config=OutputConfig(), console=console, log_dir=tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "go")], **out.popen_kwargs())
    out.start(proc)
    try:
        _wait_for(console_out, b"loading... ", proc)
        (tmp_path / "go").touch()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait(30)
        out.drain()
    assert console_out.getvalue() == b"loading... done\n"


class _Counter(io.RawIOBase):
    """A console stream that keeps only how much came, and the largest write."""

    def __init__(self) -> None:
        self.total = 0
        self.largest = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.total += len(b)
        self.largest = max(self.largest, len(b))
        return len(b)


ENDLESS = textwrap.dedent("""
    import sys
    piece = b"x" * (1 << 20)
    for stream in (sys.stdout.buffer, sys.stderr.buffer):
        for _ in range(200):  # 200 MB, no newline
            stream.write(piece)
        stream.write(b"\\n")
        stream.flush()
""")


@pytest.mark.timeout(120)
def test_a_200_mb_line_passes_through_in_pieces_and_is_never_held_whole(tmp_path):
    import tracemalloc

    from resilient_train.agent.outcut import LINE_BOUND

    out_stream, err_stream = _Counter(), _Counter()
    console = Console(out=io.BufferedWriter(out_stream), err=io.BufferedWriter(err_stream))
    tracemalloc.start()
    try:
        proc, out = _relay(tmp_path, ENDLESS, console)
        assert proc.wait(60) == 0
        out.drain(30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out_stream.total == err_stream.total == 200 * (1 << 20) + 1
    assert err_stream.largest <= LINE_BOUND + 1
    assert peak < 16 * (1 << 20), f"the relay held {peak / 2**20:.0f} MiB"  # unbounded: the whole 200 MiB line


# ------------------------------------------------------------------------ a console closed under a running job

REPO = Path(__file__).resolve().parents[2]
PRINT_SCRIPT = Path(__file__).resolve().parent / "print_script.py"


def _run_until_head_closes(tmp_path: Path, *, stderr_too: bool) -> tuple[int, str, Path]:
    """``resilient-train run ... | head`` (``2>&1 | head`` with ``stderr_too``): the test reads until both ranks
    said hello, closes its end, then lets rank 0 go on (a line on the agent's stdin), so every step's line
    meets the closed pipe. (exit code, the agent's stderr when it is not the pipe, run dir)."""
    run_dir = tmp_path / "run"
    r, w = os.pipe()
    err_path = tmp_path / "agent-stderr.txt"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
             str(PRINT_SCRIPT), "--steps", "20"], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=w,
            stderr=w if stderr_too else err)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as reader:
            seen: set[bytes] = set()
            while len(seen) < 2:
                line = reader.readline()
                assert line, f"the agent ended first ({proc.wait(30)}): {err_path.read_text()}"
                if line.startswith(b"hello from rank"):
                    seen.add(line)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        rc = proc.wait(120)
    finally:
        proc.kill()
        proc.wait(30)
    return rc, err_path.read_text(), run_dir


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(180)
def test_a_closed_stdout_is_said_once_and_the_job_trains_on_into_the_log_files(tmp_path):
    rc, err, run_dir = _run_until_head_closes(tmp_path, stderr_too=False)
    assert rc == 0, err
    logs = run_dir / "logs"
    said = [line for line in err.splitlines() if "stdout is closed" in line]
    assert said == [f"resilient-train: stdout is closed (its reader exited): the job goes on; the ranks' stdout "
                    f"goes to {logs}/attempt_N/LOCAL_RANK/stdout.log"], err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("rank1 step")] == [
        f"rank1 step {i}" for i in range(1, 21)]  # stderr still open: the console
    assert (logs / "attempt_0" / "0" / "stdout.log").read_text().splitlines() == [f"step {i}" for i in range(1, 21)]
    events = _events(run_dir)
    assert [(e["stream"], e["output"]) for e in events if e["event"] == "console_closed"] == [
        ("stdout", f"{logs}/attempt_N/LOCAL_RANK/stdout.log")]
    assert {e["rank"]: (e["step"], e["recoveries"]) for e in events if e["event"] == "run_end"} == {
        0: (20, 0), 1: (20, 0)}
    assert not [e for e in events if e["event"] == "fault_detected"]


@pytest.mark.timeout(180)
def test_a_closed_stdout_and_stderr_leave_the_job_whole_and_say_where_in_the_events(tmp_path):
    rc, _, run_dir = _run_until_head_closes(tmp_path, stderr_too=True)
    assert rc == 0
    logs = run_dir / "logs"
    assert (logs / "attempt_0" / "0" / "stdout.log").read_text().splitlines() == [f"step {i}" for i in range(1, 21)]
    assert (logs / "attempt_0" / "1" / "stderr.log").read_text().splitlines() == [
        f"rank1 step {i}" for i in range(1, 21)]
    events = _events(run_dir)
    assert sorted((e["stream"], e["output"]) for e in events if e["event"] == "console_closed") == [
        ("stderr", f"{logs}/attempt_N/LOCAL_RANK/stderr.log"), ("stdout", f"{logs}/attempt_N/LOCAL_RANK/stdout.log")]
    assert {e["rank"]: (e["step"], e["recoveries"]) for e in events if e["event"] == "run_end"} == {
        0: (20, 0), 1: (20, 0)}
    assert [e["ok"] for e in events if e["event"] == "agent_end"] == [True]


HOLD_AFTER_ENDLESS = textwrap.dedent("""
    import os, sys, time
    ready = os.path.join(os.environ["RT_RUN_DIR"], "ready")
    def handshake(name):  # tell the test, wait for its answer (it reads the agent's memory in between)
        open(f"{ready}.{name}", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{ready}.{name}.ok"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    handshake("start")
    piece = b"x" * (1 << 20)
    for stream in (sys.stdout.buffer, sys.stderr.buffer):
        for _ in range(200):  # 200 MB, no newline
            stream.write(piece)
        stream.flush()
    handshake("written")
    print(flush=True)
""")


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(180)
def test_the_agents_memory_stays_bounded_whatever_a_rank_prints(tmp_path):
    """A rank writes a 200 MB line without a newline to its stdout (a pipe here, so the agent reads it) and to
    its stderr: the agent's peak memory grows by less than a tenth of it (it grew by 570 MB)."""
    script = tmp_path / "endless.py"
    script.write_text(HOLD_AFTER_ENDLESS)
    run_dir = tmp_path / "run"
    with (tmp_path / "err.txt").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "1", "--run-dir", str(run_dir),
             str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    got = [0]

    def drain() -> None:
        while chunk := proc.stdout.read1(1 << 16):  # type: ignore[union-attr]
            got[0] += len(chunk)

    import threading

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        peaks = []
        for name in ("start", "written"):
            flag = run_dir / f"ready.{name}"
            deadline = time.monotonic() + 90
            while not flag.exists():
                assert proc.poll() is None, (tmp_path / "err.txt").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.02)
            peaks.append(_peak_rss_kib(proc.pid))
            Path(f"{flag}.ok").touch()
        assert proc.wait(60) == 0, (tmp_path / "err.txt").read_text()
        reader.join(30)
    finally:
        proc.kill()
        proc.wait(30)
    assert got[0] == 200 * (1 << 20) + 1
    assert (tmp_path / "err.txt").stat().st_size >= 200 * (1 << 20)
    assert peaks[1] - peaks[0] < 20 * 1024, f"the agent grew by {(peaks[1] - peaks[0]) / 1024:.0f} MiB"
