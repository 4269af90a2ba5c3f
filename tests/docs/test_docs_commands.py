"""Issue 34: the commands and blocks of README.md and docs/*.md, run as documented: the same flags, small sizes.

Each test takes its command's text from the docs (``documented``): the docs change it, the test fails until
it is updated with them. ``shrink`` sets only size flags (ranks, steps, a checkpoint interval) and appends the
scripts' own size flags; a ``runs/...`` path goes under the test's directory, which is the working
directory of every command (so a default ``runs/latest`` does too).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from docblocks import REPO, block, documented, shrink
from jobs import SMALL_DDP, SMALL_GPT, Job
from monitors import read_events

SMALL_FSDP = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4", "--dataset", "256",
              "--log-every", "0", "--reproducible"]


def _repo_paths(argv: list[str]) -> list[str]:
    """The repository's files named relatively (``examples/train_ddp.py``), absolute: the commands run in the
    test's directory."""
    return [str(REPO / a) if a.startswith("examples/") else a for a in argv]


def _run(argv: list[str], cwd: Path, *, timeout: float = 240, run_dir: Path | None = None) -> Job:
    p = subprocess.run(_repo_paths(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    return Job(p.returncode, p.stdout, p.stderr, run_dir or cwd)


def _committed(run_dir: Path) -> list[int]:
    return sorted(e["step"] for e in read_events(run_dir / "events.jsonl")
                  if e["event"] == "checkpoint_committed" and e.get("rank") == 0)


@pytest.mark.timeout(600)
def test_the_ddp_example_with_the_run_config_commits_every_interval_and_ends_bitwise(tmp_path: Path) -> None:
    """The README's launch of examples/train_ddp.py; then the Configuration section's command, the run config
    of examples/run.yaml with ``--checkpoint.interval=20``: it trains and commits every 20 steps (its ranks died
    of it once: the section lacked the supervisor's own ``local`` key); the two final states are bitwise equal
    (``ckpt diff``: a checkpoint changes nothing of the training)."""
    launch = documented("command", "resilient-train run --nproc-per-node 4 --run-dir runs/demo examples/train_ddp.py "
                                   "--steps 200")
    plain = _run(shrink(launch.text, tmp_path, sizes={"--nproc-per-node": "2", "--steps": "40"}, append=SMALL_DDP),
                 tmp_path, run_dir=tmp_path / "runs" / "demo")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert _committed(plain.run_dir) == []

    config = documented("command", "resilient-train run --config examples/run.yaml --nproc-per-node 4 "
                                   "--checkpoint.interval=20 examples/train_ddp.py")
    job = _run(shrink(config.text, tmp_path, sizes={"--nproc-per-node": "2"}, append=["--steps", "40", *SMALL_DDP]),
               tmp_path, run_dir=tmp_path / "runs" / "latest")  # run.yaml's agent.run_dir
    assert job.returncode == 0, job.stderr[-3000:]
    assert _committed(job.run_dir) == [20, 40]
    kept = sorted(p.name for p in (job.run_dir / "checkpoints").glob("step-*"))
    assert kept == ["step-20", "step-40"]  # run.yaml's keep_last: 2
    assert "is not used" not in job.stderr, job.stderr[-3000:]

    diff = documented("command", "resilient-train ckpt diff runs/a/final runs/b/final")
    argv = shrink(diff.text.replace("runs/a", "runs/demo").replace("runs/b", "runs/latest"), tmp_path)
    d = _run(argv, tmp_path)
    assert d.returncode == 0, d.stdout + d.stderr


QUICK_START_PRELUDE = '''
import torch

seed = 0


class MyModel(torch.nn.Module):  # the user's model: (inputs, targets) -> loss
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layer(x), y)


def batch_for(seed, step, rank):  # the user's data: a function of (seed, step, rank)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(1, keepdim=True)
'''


@pytest.mark.timeout(300)
def test_the_quick_start_block_trains_under_the_agent(tmp_path: Path) -> None:
    """The README's first block, with the user's model and data filled in and fewer steps, launched as the
    README launches a script."""
    code = block("README.md:python:batch_for")
    assert "steps=1000" in code.text
    script = tmp_path / "quick_start.py"
    script.write_text(QUICK_START_PRELUDE + code.text.replace("steps=1000", "steps=6"))
    launch = documented("command", "resilient-train run --nproc-per-node 4 --run-dir runs/demo examples/train_ddp.py "
                                   "--steps 200")
    argv = shrink(launch.text.replace("examples/train_ddp.py --steps 200", str(script)), tmp_path,
                  sizes={"--nproc-per-node": "2"})
    job = _run(argv, tmp_path, run_dir=tmp_path / "runs" / "demo")
    assert job.returncode == 0, job.stderr[-3000:]
    assert max(e["step"] for e in job.events() if e["event"] == "step_done") == 6
    assert (job.run_dir / "final").is_dir()


SHARDED_PRELUDE = f'''
import sys

import torch

sys.path.insert(0, {str(REPO / "examples")!r})
from train_gpt import GPT, GPTConfig, batch  # the user's model and data

cfg = GPTConfig(d_model=32, layers=2, heads=2, seq_len=16)


def train_step(ctx):
    x, y = batch(0, ctx.step, ctx.data_rank, size=4, cfg=cfg, device=ctx.device)
    loss = sharded(x, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.detach()
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sharded_block_trains_under_the_agent(tmp_path: Path) -> None:
    """docs/sharded.md's block (FSDP2 over a 1-D mesh) with the user's model, data and step filled in."""
    code = block("docs/sharded.md:python:sup.sharded")
    assert "steps=1000" in code.text
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_PRELUDE + code.text.replace("steps=1000", "steps=4"))
    job = _run([sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "2", "--run-dir",
                str(tmp_path / "run"), str(script)], tmp_path, run_dir=tmp_path / "run")
    assert job.returncode == 0, job.stderr[-3000:]
    assert max(e["step"] for e in job.events() if e["event"] == "step_done") == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_sharded_commands_reshard_4_ranks_to_2(tmp_path: Path) -> None:
    """docs/sharded.md: a job on 4 FSDP ranks goes on with another --nproc-per-node on the same run directory,
    from its checkpoint, resharded (the first stops at step 2 here, as a preempted job would have)."""
    four = documented("command", "resilient-train run --nproc-per-node 4 --run-dir runs/fsdp examples/train_fsdp.py "
                                 "--steps 100 --ckpt-every 10")
    two = documented("command", "resilient-train run --nproc-per-node 2 --run-dir runs/fsdp examples/train_fsdp.py "
                                "--steps 100 --ckpt-every 10")
    run_dir = tmp_path / "runs" / "fsdp"
    first = _run(shrink(four.text, tmp_path, sizes={"--steps": "2", "--ckpt-every": "2"}, append=SMALL_FSDP),
                 tmp_path, run_dir=run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _committed(run_dir) == [2]
    first_end = first.events()[-1]["time"]
    second = _run(shrink(two.text, tmp_path, sizes={"--steps": "4", "--ckpt-every": "2"}, append=SMALL_FSDP),
                  tmp_path, run_dir=run_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = [e for e in second.events() if e["event"] == "resumed_from_disk" and e["time"] > first_end]
    assert sorted((e["rank"], e["step"]) for e in resumed) == [(0, 2), (1, 2)]
    assert max(e["step"] for e in second.events() if e["event"] == "step_done") == 4


def _dashboard_lines(sample: str, port: str = r"\d+") -> list[re.Pattern[str]]:
    """The README's sample lines as patterns: its port and token are examples."""
    return [re.compile(re.escape(line).replace("8470", port).replace(re.escape("3q0v..."), r"[\w-]{16,}") + "$")
            for line in sample.splitlines()]


@pytest.mark.timeout(600)
def test_the_dashboard_commands(tmp_path: Path) -> None:
    """The dashboard section: a job with ``--dashboard``, the page of its run directory served and exported.
    Both print the URL and the token as the README shows them; the API answers with the token only."""
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    patterns = _dashboard_lines(block("README.md:indented:dashboard token").text)
    run = documented("command", "resilient-train run --dashboard --nproc-per-node 4 --run-dir runs/demo "
                                "examples/train_gpt.py --steps 2000")
    job = _run(shrink(run.text, tmp_path, sizes={"--nproc-per-node": "2", "--steps": "12"}, append=SMALL_GPT),
               tmp_path, run_dir=tmp_path / "runs" / "demo")
    assert job.returncode == 0, job.stderr[-3000:]
    said = (job.stdout + job.stderr).splitlines()
    assert all(any(p.match(line) for line in said) for p in patterns), said[:20]

    export = documented("command", "resilient-train dashboard runs/demo --export report.html")
    e = _run(shrink(export.text, tmp_path), tmp_path)
    assert e.returncode == 0, e.stderr
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!doctype html>") or "<html" in page[:500]
    assert '"ranks_started":2' in page and '"last":12' in page  # the run's own data: 2 ranks, 12 steps

    serve = documented("command", "resilient-train dashboard runs/demo [--port 8470] [--host 127.0.0.1]")
    argv = _repo_paths(shrink(serve.text.replace("[", "").replace("]", ""), tmp_path, sizes={"--port": "0"}))
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while len(lines) < len(patterns) and time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line:
                break
            if line.startswith("dashboard"):
                lines.append(line.rstrip("\n"))
        assert len(lines) == len(patterns) and all(p.match(s) for p, s in zip(patterns, lines)), lines
        url, token = lines[0].split(" ", 1)[1].split("#token=")
        with urllib.request.urlopen(urllib.request.Request(f"{url}api/state", headers={"X-Dashboard-Token": token}),
                                    timeout=30) as r:
            state = json.loads(r.read())
        assert state, state
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}api/state", timeout=30)
        assert refused.value.code == 403
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_demo(tmp_path: Path) -> None:
    """The first command of the README, at the sizes its own flags set (`resilient-train demo [--steps N]
    [--nproc-per-node N]`): two runs, a killed and a raising rank, bitwise equal."""
    install = documented("command", "pip install torch==2.13.0 && pip install -e . && resilient-train demo")
    demo = install.text.rsplit("&& ", 1)[1]
    job = _run(shrink(demo, tmp_path, append=["--steps", "6", "--nproc-per-node", "2"]), tmp_path, timeout=540)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "Final states: bitwise identical" in job.stdout, job.stdout[-3000:]
