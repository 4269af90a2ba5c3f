"""The fault-free reference run, cached by a hash of the job."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from chaos.driver import JobRun, run_job
from chaos.scenario import JobSpec

__all__ = ["Reference", "default_cache_dir", "ensure_reference", "job_hash"]

# Packages whose code decides the final state; chaos and monitors do not.
_RUNTIME_PACKAGES = ("resilient_train", "checkpointing")


@dataclass(frozen=True, kw_only=True)
class Reference:
    path: Path  # holds final/, events.jsonl, job.log and reference.json
    key: str
    cached: bool
    wall_s: float

    @property
    def final(self) -> Path:
        return self.path / "final"


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "resilient-train" / "chaos-references"


def job_hash(job: JobSpec) -> str:
    """Changes when anything that decides the final state changes: the script, its arguments, the ranks,
    the environment, torch, or the runtime's code."""
    h = hashlib.sha256()
    h.update(Path(job.script).read_bytes())
    h.update(json.dumps({"argv": job.argv()[1:], "ranks": job.ranks, "env": sorted(job.env.items())}).encode())
    h.update(_runtime_digest().encode())
    return h.hexdigest()[:20]


@functools.lru_cache(maxsize=1)
def _runtime_digest() -> str:
    """torch's version and the runtime's code, read once per process: a matrix shares one reference
    even while its code is being edited."""
    import torch

    h = hashlib.sha256(torch.__version__.encode())
    for name in _RUNTIME_PACKAGES:
        spec = importlib.util.find_spec(name)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            for f in sorted(Path(loc).rglob("*.py")):
                h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def ensure_reference(job: JobSpec, cache_dir: Path, *, timeout_s: float, use_cache: bool = True) -> Reference:
    key = job_hash(job)
    done = Path(cache_dir) / key
    if use_cache and (done / "reference.json").is_file() and (done / "final").is_dir():
        meta = json.loads((done / "reference.json").read_text())
        return Reference(path=done, key=key, cached=True, wall_s=float(meta["wall_s"]))
    tmp = Path(cache_dir) / f"{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    run: JobRun = run_job(job, tmp, faults=[], timeout_s=timeout_s)
    if run.returncode != 0 or not (tmp / "final").is_dir():
        why = "timed out" if run.timed_out else f"exit code {run.returncode}"
        raise RuntimeError(f"the fault-free reference run failed ({why}); see {tmp / 'job.log'}:\n{run.log_tail()}")
    (tmp / "reference.json").write_text(json.dumps({"key": key, "wall_s": run.wall_s, "argv": job.argv()}))
    if done.exists():
        shutil.rmtree(done, ignore_errors=True)
    try:
        os.rename(tmp, done)
    except OSError:  # another process cached the same job meanwhile: theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"chaos: fault-free reference cached at {done}", file=sys.stderr)
    return Reference(path=done, key=key, cached=False, wall_s=run.wall_s)
