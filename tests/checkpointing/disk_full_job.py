"""Runs two disk_full_worker ranks around one TCPStore and prints every line they printed (with the rank).

Started by the test inside a private mount namespace where ``--dir``'s filesystem is a small tmpfs, so the
workers (children of this process) share that namespace and that full filesystem.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def main() -> int:
    *worker_args, = sys.argv[1:]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs = [subprocess.Popen([sys.executable, str(HERE / "disk_full_worker.py"), "--rank", str(r), "--world", "2",
                               "--port", str(store.port), *worker_args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
             for r in (0, 1)]
    code = 0
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=150)
        for line in out.splitlines():
            print(json.dumps({"rank": r, **json.loads(line)}))
        print(json.dumps({"rank": r, "exit": p.returncode, "stderr": err[-3000:]}))
        code |= p.returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
