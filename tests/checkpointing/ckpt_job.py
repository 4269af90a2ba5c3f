"""Runs ``ckpt_worker.py`` as a job of N real processes around one TCPStore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass
class Job:
    procs: list[subprocess.Popen[str]]
    store: dist.TCPStore

    def wait(self, timeout: float = 240) -> list[tuple[int, list[dict[str, Any]], str]]:
        out = []
        for p in self.procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, [json.loads(l) for l in stdout.splitlines() if l.startswith("{")], stderr))
        return out

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.communicate(timeout=60)


def start_job(
    world: int,
    directory: Path,
    *,
    save: str = "",
    load: bool = False,
    env: dict[int, dict[str, str]] | None = None,
    extra: list[str] | None = None,
    timeout: float = 150.0,
) -> Job:
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timedelta(seconds=180), wait_for_workers=False)
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e["OMP_NUM_THREADS"] = "1"
        e.pop("RESILIENT_TRAIN_CKPT_KILL_AT", None)
        e.update((env or {}).get(rank, {}))
        cmd = [
            sys.executable, str(HERE / "ckpt_worker.py"), "--rank", str(rank), "--world", str(world),
            "--port", str(store.port), "--dir", str(directory), "--events", str(directory.parent / "events.jsonl"),
            "--save", save, "--timeout", str(timeout),
        ] + (["--load"] if load else []) + (extra or [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e))
    return Job(procs=procs, store=store)
