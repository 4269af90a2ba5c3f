"""A warm spare, in its own process: an interpreter that has imported torch, waiting to become a rank.

The agent's pool (resilient_train.agent.spares) starts it as::

    python -u -c BOOT CONTROL_FD PATH0 SCRIPT ARGS...     (or ... PATH0 -m MODULE ARGS...)

with the environment a worker of its node gets, less the keys that name the
rank (``spares.LATE_KEYS``), so that whatever torch sizes or reads at import
(its thread pools from ``OMP_NUM_THREADS``, allocator and ``CUDA_*``
settings) is what a cold worker reads. ``BOOT`` puts ``PATH0`` (the script's
directory, or the cwd for ``-m``, as ``python`` would) first on ``sys.path``
before anything is imported. The spare imports torch, warms what scripts load
lazily, tells the agent it is ready (one byte on the control socket), and
waits. At the handover the agent sends one message: the rank's full
environment, argv and cwd, and, as SCM_RIGHTS, the fds 0, 1 and 2 a cold
worker of that rank would get (the agent's stdin, the pipes its relay reads).
The spare puts them in place, replays what it printed while warming, and runs
the script in ``__main__`` as ``python`` runs it. If the agent goes away
first, the socket closes and the spare exits 0. While it waits it ignores the
signals that stop a job (checkpointing.stopsignals): they are sent to every
process of a job, and a spare must outlive the stop it may be needed for.
"""

from __future__ import annotations

import array
import builtins
import importlib.machinery
import json
import os
import signal
import socket
import struct
import sys
import threading
from typing import Any

__all__ = ["BOOT", "READY", "main"]

BOOT = ("import sys; sys.path[0] = sys.argv[2]; "
        "sys.exit(__import__('resilient_train.agent.spare', fromlist=['main']).main())")
READY = b"R"  # the spare's one byte once warm
_HEADER = struct.Struct("!I")  # the handover's length, ahead of its JSON


def _warm_up() -> None:
    """Touches what a training script's first lines load lazily (about 1 s cold); leaves torch's RNG as it was."""
    import torch

    rng = torch.random.get_rng_state()
    with torch.device("meta"):
        layer = torch.nn.Linear(2, 2)
    layer = layer.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(layer.parameters())  # imports torch._dynamo
    layer(torch.zeros(1, 2)).sum().backward()
    optimizer.step()
    import torch.distributed.checkpoint  # noqa: F401

    torch.random.set_rng_state(rng)


def main() -> int:
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    start_env = dict(os.environ)
    import torch  # noqa: F401  (the point of a spare: pay the import now)
    import torch.distributed  # noqa: F401

    import resilient_train  # noqa: F401

    _warm_up()
    try:
        ctrl.sendall(READY)
    except OSError:
        pass  # taken while warming: the agent sent the handover and closed its end; the message waits here
    try:
        handover = _receive(ctrl)
    except OSError:
        return 0
    finally:
        ctrl.close()
    if handover is None:
        return 0  # the agent went away, or gave this spare up
    spec, fds = handover
    _become(spec, fds, start_env)
    return _run(spec)


def _receive(ctrl: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The handover: (spec, [fd0, fd1, fd2]), or None once the agent closed the socket."""
    data, fds = bytearray(), array.array("i")
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        chunk, ancdata, _, _ = ctrl.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None
        data += chunk
    assert len(fds) == 3, f"a handover carries fds 0, 1 and 2, got {len(fds)}"
    return json.loads(data[_HEADER.size:]), list(fds)


def _become(spec: dict[str, Any], fds: list[int], start_env: dict[str, str]) -> None:
    """Takes the rank's fds, environment, cwd and argv: what ``python`` would have set for it."""
    sys.stdout.flush()
    sys.stderr.flush()
    early = (os.dup(1), os.dup(2))  # what warming printed (files the agent gave the spare)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    for fd, target in zip(early, (1, 2)):
        _replay(fd, target)  # a cold worker would have printed it too, at its own import
    # What the imports set themselves (torch sets TORCHINDUCTOR_CACHE_DIR) is kept, as in a cold
    # worker that ran them; the rest is the rank's environment.
    env = dict(spec["env"])
    for key, value in os.environ.items():
        if start_env.get(key) != value:
            env.setdefault(key, value)
    for key in start_env.keys() - os.environ.keys():
        env.pop(key, None)
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    os.chdir(spec["cwd"])
    sys.orig_argv[:] = spec["orig_argv"]
    sys.path[0] = spec["path0"]
    _take_cold_signals(spec.get("ignored_signals", []))


def _take_cold_signals(ignored: list[str]) -> None:
    """The stop signals the spare ignored while it waited (resilient_train.agent.spares) get a cold worker's
    dispositions: ignored where the agent ignores them, else the default (``python``'s KeyboardInterrupt for
    SIGINT)."""
    from checkpointing.stopsignals import STOP_SIGNALS

    for signum in STOP_SIGNALS:
        if signal.Signals(signum).name in ignored:
            signal.signal(signum, signal.SIG_IGN)
        elif signum == signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)
        else:
            signal.signal(signum, signal.SIG_DFL)


def _replay(fd: int, target: int) -> None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        while chunk := os.read(fd, 1 << 16):
            os.write(target, chunk)
    except OSError:
        pass
    finally:
        os.close(fd)


def _run(spec: dict[str, Any]) -> int:
    """Runs the script (or module) in ``__main__``; an uncaught exception is reported as ``python`` does."""
    import runpy

    argv = spec["argv"]  # what follows "python -u": SCRIPT ARGS, or -m MODULE ARGS
    main_globals = sys.modules["__main__"].__dict__
    main_globals.clear()
    main_globals.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None, __annotations__={},
                        __builtins__=builtins)
    try:
        if argv[0] == "-m":
            sys.argv[:] = ["-m", *argv[2:]]
            main_globals["__loader__"] = importlib.machinery.BuiltinImporter
            # What ``python -m`` calls: it runs the module in the real __main__ and sets sys.argv[0].
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
            return 0
        sys.argv[:] = argv
        path = argv[0] if os.path.isabs(argv[0]) else os.path.join(os.getcwd(), argv[0])  # python's __file__
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as e:
            print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
            return 2
        main_globals.update(__file__=path, __cached__=None,
                            __loader__=importlib.machinery.SourceFileLoader("__main__", path))
        exec(compile(source, path, "exec", dont_inherit=True), main_globals)  # no __future__ of ours
        return 0
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (python's own top level: print it, exit 1)
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # without this frame
        e.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        sys.excepthook(type(e), e, tb)
        if isinstance(e, KeyboardInterrupt):
            _exit_by_sigint()
        return 1


def _exit_by_sigint() -> None:
    """An uncaught KeyboardInterrupt: python finalizes, then dies of SIGINT (the exit status says so)."""
    import atexit

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
