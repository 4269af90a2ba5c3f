"""A warm spare worker: an interpreter with torch already imported, waiting.

The agent starts one ahead of need. When a rank dies, the agent writes one
JSON line to the spare's stdin (the replacement's argv, environment and
working directory) and the spare becomes that rank, saving the seconds a cold
interpreter spends importing torch. If the agent goes away first, stdin closes
and the spare exits.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

__all__ = ["SPARE_READY_FD", "main"]

SPARE_READY_FD = "RT_SPARE_READY_FD"  # the spare writes one byte there once warm


def _warm_up() -> None:
    """Touches what a training script's first lines load lazily (about 1 s cold)."""
    import torch

    with torch.device("meta"):
        layer = torch.nn.Linear(2, 2)
    layer = layer.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(layer.parameters())  # imports torch._dynamo
    layer(torch.zeros(1, 2)).sum().backward()
    optimizer.step()
    import torch.distributed.checkpoint  # noqa: F401


def main() -> int:
    import torch  # noqa: F401  (the point of a spare: pay the import now)
    import torch.distributed  # noqa: F401

    import resilient_train  # noqa: F401

    _warm_up()
    ready_fd = os.environ.pop(SPARE_READY_FD, None)
    if ready_fd is not None:
        try:
            os.write(int(ready_fd), b"1")
            os.close(int(ready_fd))
        except OSError:
            pass
    line = sys.stdin.readline()
    if not line:
        return 0
    spec = json.loads(line)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    argv = spec["argv"]  # what follows "python": SCRIPT ARGS, or -m MODULE ARGS
    sys.stdin.close()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
