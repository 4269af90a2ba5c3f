"""What relaying the ranks' output costs the agent: its own CPU time (not its ranks') for a job that prints.

    python bench/console_relay.py [--repo-before DIR] [--steps 400] [--lines 200000] [--runs 3]

Since the ranks' stdout passes through the agent whenever the agent's stdout is a
pipe (so ``| head`` cannot break a rank, resilient_train.agent.console), a job that
prints every step costs the agent a read and a write per line. Measured here:

* ``gpt``: the GPT example, 2 ranks, ``--log-every 1`` (rank 0 prints every
  step), the agent's stdout a pipe this bench drains, or a file (the ranks
  write into it themselves, as before);
* ``flood``: 2 ranks that print ``--lines`` lines each to stdout and as many
  to stderr, as fast as they can (the worst case, no training).

``--repo-before DIR``: a checkout of the code before the change (e.g. ``git
archive BASE | tar -x -C DIR``): the same runs with its code, side by side.

The agent's CPU time (utime + stime of the agent process alone) is read from
/proc once it exited and before it is reaped (waitid WNOWAIT), so nothing it
spent is missed and nothing of its ranks is counted. A whole agent's CPU is
mostly its start (torch's import) and its 50 ms loop, so the relay's own cost
per line is measured apart too (``relay``): one worker's ``WorkerOutput`` in
this process, a child printing N lines to one stream as fast as it can
(``flood``) or one a millisecond (``paced``: a wakeup a line, as a job that
prints every step), the console a null sink; this process's CPU time per line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT_ARGS = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch", "4", "--log-every", "1"]
CLK = os.sysconf("SC_CLK_TCK")
FLOOD = """
import sys
n = int(sys.argv[1])
for i in range(n):
    print(f"step {i} loss 1.2345 lr 0.001 tokens/s 123456", flush=True)
    print(f"INFO step {i} took 12.3 ms", file=sys.stderr, flush=True)
"""


def agent_run(repo: Path, args: list[str], *, to_pipe: bool, tmp: Path) -> tuple[float, float, int]:
    """(agent CPU s, wall s, bytes on stdout) of one ``resilient-train run``."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    out_file = (tmp / "stdout.txt").open("wb")
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--no-spare", *args]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE if to_pipe else out_file,
                            stderr=subprocess.DEVNULL)
    got = [0]

    def drain() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):
            got[0] += len(chunk)

    reader = threading.Thread(target=drain) if to_pipe else None
    if reader is not None:
        reader.start()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: /proc still has its times
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK
    wall = time.monotonic() - start
    rc = proc.wait()
    if reader is not None:
        reader.join()
    out_file.close()
    if rc != 0:
        raise SystemExit(f"run failed ({rc}): {' '.join(cmd)}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return cpu, wall, got[0] if to_pipe else (tmp / "stdout.txt").stat().st_size


RELAY = """
import io, resource, subprocess, sys, tempfile
from pathlib import Path
from resilient_train.agent.workerio import Console, OutputConfig, WorkerOutput
stream, paced, n, silent = sys.argv[1], sys.argv[2] == "paced", int(sys.argv[3]), sys.argv[4] == "silent"
child = (f"import sys, time\\nfor i in range({n}):\\n    " + ("pass" if silent else
         f"print(f'step {{i}} loss 1.2345 lr 0.001', file=sys.{stream}, flush=True)") + "\\n"
         + ("    time.sleep(0.001)\\n" if paced else ""))
class Null(io.RawIOBase):
    def writable(self): return True
    def write(self, b): return len(b)
console = Console(out=io.BufferedWriter(Null()), err=io.BufferedWriter(Null()))
r0 = resource.getrusage(resource.RUSAGE_SELF)
out = WorkerOutput(rank=0, local_rank=0, attempt=0, config=OutputConfig(), console=console,
                   log_dir=Path(tempfile.mkdtemp()))
p = subprocess.Popen([sys.executable, "-c", child], **out.popen_kwargs())
out.start(p); p.wait(); out.drain()
r1 = resource.getrusage(resource.RUSAGE_SELF)
print((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n * 1e6, file=sys.stderr)
"""


def relay_us(repo: Path, stream: str, pace: str, n: int) -> float:
    """The relay's CPU microseconds per line: the same child printing and silent, the difference (what starting
    and waiting for the child cost is in both). Its stdout is /dev/null: a worker writes there itself unless read."""

    def cpu(silent: str) -> float:
        p = subprocess.run([sys.executable, "-c", RELAY, stream, pace, str(n), silent],
                           env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, check=True)
        return float(p.stderr.split()[-1])

    return cpu("print") - cpu("silent")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo-before", type=Path, default=None)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rt-relay-bench-"))
    flood = tmp / "flood.py"
    flood.write_text(FLOOD)
    repos = {"after": REPO, **({"before": a.repo_before.resolve()} if a.repo_before else {})}
    cases = {"gpt": [str(REPO / "examples" / "train_gpt.py"), "--steps", str(a.steps), *GPT_ARGS],
             "flood": [str(flood), str(a.lines)]}
    print(f"relay CPU per line, microseconds (median of {a.runs})")
    for stream in ("stdout", "stderr"):
        for pace, n in (("flood", 100_000), ("paced", 5_000)):
            row = []
            for name, repo in repos.items():
                runs = sorted(relay_us(repo, stream, pace, n) for _ in range(a.runs))
                row.append(f"{name} {runs[len(runs) // 2]:6.2f}")
            print(f"{stream} {pace:5s} ({n} lines): " + ", ".join(row), flush=True)
    print(f"agent CPU seconds (median of {a.runs}), 2 ranks; wall seconds in brackets")
    for case, args in cases.items():
        for name, repo in repos.items():
            for to_pipe in (False, True):
                runs = [agent_run(repo, args, to_pipe=to_pipe, tmp=tmp) for _ in range(a.runs)]
                runs.sort()
                cpu, wall, nbytes = runs[len(runs) // 2]
                where = "pipe" if to_pipe else "file"
                print(f"{case:6s} {name:7s} stdout to a {where}: {cpu:6.2f} s  [{wall:6.1f} s]  {nbytes} bytes",
                      flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
