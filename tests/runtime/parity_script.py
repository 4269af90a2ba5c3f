"""A tiny supervised job whose ranks record what their process inherited (tests/runtime/test_spares.py).

At import, before anything else of the job, each rank writes ``RUN_DIR/parity/rank{R}-{PID}.json``
(environment, torch's thread pools, sys.*, the cwd, signal handlers, resource limits, fds 0-2) and
prints one line to stdout and one to stderr. Arguments:

* ``--hold-step K``: rank 1 of generation 0 stops at step K, writes ``RUN_DIR/parity/hold``, and
  waits to be killed from outside (the test's SIGKILL);
* ``--print-kb N``: a replacement prints N KiB to stdout before it joins.
"""

import argparse
import json
import os
import resource
import signal
import stat
import sys
import threading
import time

import torch

import resilient_train as rt


def _handler(h: object) -> str:
    if h in (signal.SIG_DFL, signal.SIG_IGN, None):
        return str(h)
    return getattr(h, "__qualname__", repr(h))


def _fd(fd: int) -> dict:
    try:
        st = os.fstat(fd)
    except OSError:
        return {"open": False}
    kind = ("fifo" if stat.S_ISFIFO(st.st_mode) else "chr" if stat.S_ISCHR(st.st_mode)
            else "reg" if stat.S_ISREG(st.st_mode) else "sock" if stat.S_ISSOCK(st.st_mode) else "other")
    return {"open": True, "kind": kind, "dev": st.st_dev, "ino": st.st_ino, "flags": os.get_blocking(fd)}


def facts() -> dict:
    main = sys.modules["__main__"]
    return {
        "pid": os.getpid(), "ppid": os.getppid(), "pgrp": os.getpgrp(), "sid": os.getsid(0),
        "environ": dict(os.environ),
        "num_threads": torch.get_num_threads(), "num_interop_threads": torch.get_num_interop_threads(),
        "sys_path": sys.path, "argv": sys.argv, "orig_argv": sys.orig_argv, "flags": list(sys.flags),
        "executable": sys.executable, "cwd": os.getcwd(),
        "main_file": main.__file__, "main_keys": sorted(k for k in vars(main) if k.startswith("__")),
        "main_loader": type(main.__loader__).__name__, "main_cached": main.__cached__, "main_spec": repr(main.__spec__),
        "signals": {s.name: _handler(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")},
        "fds": {str(fd): _fd(fd) for fd in (0, 1, 2)},
        "stdin_closed": sys.stdin.closed, "stdout_line_buffering": sys.stdout.line_buffering,
        "stdout_write_through": sys.stdout.write_through, "stdio_encoding": [sys.stdin.encoding, sys.stdout.encoding],
        "threads": sorted(t.name for t in threading.enumerate()),
        "affinity": sorted(os.sched_getaffinity(0)), "nice": os.nice(0), "umask": _umask(),
        "grad": torch.is_grad_enabled(), "dtype": str(torch.get_default_dtype()),
    }


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--hold-step", type=int, default=-1)
p.add_argument("--print-kb", type=int, default=0)
args = p.parse_args()
env = rt.WorkerEnv.from_environ()
out_dir = os.path.join(env.run_dir, "parity")
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, f"rank{env.rank}-{os.getpid()}.json"), "w") as f:
    json.dump(facts(), f)
print(f"parity-out rank {env.rank} pid {os.getpid()}", flush=True)
print(f"parity-err rank {env.rank} pid {os.getpid()}", file=sys.stderr, flush=True)
if env.replacement and args.print_kb:
    line = "x" * 1023 + "\n"  # 1 KiB a line
    for i in range(args.print_kb):
        sys.stdout.write(f"bulk {i:07d} " + line[13:])
    print(f"parity-bulk-done rank {env.rank} pid {os.getpid()}", flush=True)

env_written: list[bool] = []
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(ctx: rt.StepContext) -> torch.Tensor:
    if not env_written:  # the environment this process's steps run in (torch sets some of it lazily)
        env_written.append(True)
        with open(os.path.join(out_dir, f"env{env.rank}-{os.getpid()}.json"), "w") as f:
            json.dump(dict(os.environ), f)
    if ctx.step == args.hold_step and ctx.rank == 1 and not env.replacement:
        with open(os.path.join(out_dir, "hold.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(out_dir, "hold.tmp"), os.path.join(out_dir, "hold"))  # the test reads a whole pid
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the test kills it long before
            time.sleep(0.05)
        raise RuntimeError("held rank was not killed")
    loss = model(torch.ones(4, 8) * (ctx.rank + 1)).square().sum()
    optimizer.zero_grad()
    loss.backward()
    ctx.average_gradients()
    optimizer.step()
    return loss.detach()


rt.Supervisor(rt.SupervisorConfig(steps=args.steps)).run(train_step, rt.TrainState(model=model, optimizer=optimizer))
