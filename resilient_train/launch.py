"""``resilient-train run``'s flags: torchrun's, with torchrun's meaning, and ours.

Every flag of ``torchrun`` (torch 2.13) is parsed here. Each one either does
what it does under torchrun, or is refused with one line that names it and
says why (README: "Compatibility with torchrun"). They set fields of the run
config's ``agent`` section (:func:`agent_fields`, over ``--config FILE``);
``--SECTION.FIELD=VALUE`` sets any field (``resilient_train.runflags`` puts
the layers together). Nothing starts before every flag has been checked.
"""

from __future__ import annotations

import argparse
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

from resilient_train.base.cliargs import MAX_SECONDS, check_host, host, integer, number, port
from resilient_train.agent.config import SIGNALS
from resilient_train.agent.entry import Entry, EntryKind
from resilient_train.protocol.jobtoken import read_token_file
from resilient_train.runconfig import RunConfig, parse_key_value
from resilient_train.agent.slurmenv import slurm_defaults
from resilient_train.agent.workerio import parse_std_streams

__all__ = ["RC", "add_run_arguments", "agent_fields"]

C10D_DEFAULT_PORT = 29400  # torchrun's port for an --rdzv-endpoint given without one
_RDZV_BACKENDS = ("static", "c10d")
_RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "timeout", "read_timeout", "is_host",
                   "keep_alive_interval", "keep_alive_max_attempt", "use_libuv")
_SIGNALS = SIGNALS


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun's flags (both spellings), then resilient-train's own."""
    t = p.add_argument_group("torchrun's flags (same meaning as under torchrun)")
    t.add_argument("--nnodes", default=None, help="nodes: N, or MIN:MAX for an elastic job (it runs on MIN to MAX "
                   "nodes, its data-parallel width fixed at MAX nodes' ranks); under srun: SLURM_NNODES")
    t.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="workers on this node: N, auto, cpu or gpu (default 1)")
    t.add_argument("--rdzv-backend", "--rdzv_backend", default="static", help="static or c10d (one node: the agent's store)")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST[:PORT] of the store (default port 29400)")
    t.add_argument("--rdzv-id", "--rdzv_id", default="none", help="the job's id (TORCHELASTIC_RUN_ID)")
    t.add_argument("--rdzv-conf", "--rdzv_conf", default="", help="KEY=VALUE,... rendezvous settings (accepted, see README)")
    t.add_argument("--standalone", action="store_true", help="one node, the store on a free local port")
    t.add_argument("--max-restarts", "--max_restarts", type=integer(low=0), default=0,
                   help="restarts of every worker before giving up (default 0, as torchrun)")
    t.add_argument("--monitor-interval", "--monitor_interval", type=number(above=0, high=60), default=0.05,
                   help="seconds between looks at the workers (default 0.05)")
    t.add_argument("--start-method", "--start_method", default="spawn", choices=("spawn", "fork", "forkserver"),
                   help="accepted: a script's workers are always fresh processes, as under torchrun")
    t.add_argument("--event-log-handler", "--event_log_handler", default="null",
                   help="only 'null': events go to RUN_DIR/events.jsonl")
    t.add_argument("--role", default="default", help="the workers' role (ROLE_NAME, and the console prefix)")
    t.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, as python -m")
    t.add_argument("--no-python", "--no_python", action="store_true", help="run SCRIPT as a program, without python")
    t.add_argument("--run-path", "--run_path", action="store_true", help="accepted: the same as running the script")
    t.add_argument("--log-dir", "--log_dir", default=None, help="per-attempt, per-rank stdout/stderr/error files go here")
    t.add_argument("-r", "--redirects", default="0", help="streams to files only: 0 none, 1 stdout, 2 stderr, 3 both; "
                   "or per rank, e.g. 0:1,1:2")
    t.add_argument("-t", "--tee", default="0", help="streams to files and to the console (same format)")
    t.add_argument("--local-ranks-filter", "--local_ranks_filter", default="",
                   help="show only these local ranks' output on the console, e.g. 0,2")
    t.add_argument("--duplicate-stdout-filters", "--duplicate_stdout_filters", nargs="*", default=[],
                   help="refused: use --log-dir")
    t.add_argument("--duplicate-stderr-filters", "--duplicate_stderr_filters", nargs="*", default=[],
                   help="refused: use --log-dir")
    t.add_argument("--node-rank", "--node_rank", type=integer(low=0), default=None,
                   help="this node's rank (default 0; under srun: SLURM_NODEID)")
    t.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of the store, node 0 (default 127.0.0.1; under srun: the first host of the job)")
    t.add_argument("--master-port", "--master_port", type=port, default=None,
                   help="port of the store, kept across restarts (default: a free one)")
    t.add_argument("--local-addr", "--local_addr", type=host("--local-addr"), default=None,
                   help="accepted: one node connects on --master-addr")
    t.add_argument("--logs-specs", "--logs_specs", default=None, help="refused: use --log-dir")
    t.add_argument("--numa-binding", "--numa_binding", default=None, help="refused (GPU affinity is not handled)")
    t.add_argument("--signals-to-handle", "--signals_to_handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                   help="signals forwarded to the workers before the agent exits (SIGUSR1 added: Slurm's "
                        "--signal; Supervisor ranks take SIGTERM and SIGUSR1 for a preemption)")
    t.add_argument("--shutdown-timeout", "--shutdown_timeout", type=number(low=0, high=MAX_SECONDS), default=None,
                   help="seconds the workers get after a forwarded signal before SIGKILL (default 30); "
                        "a Supervisor job's ranks get their preemption grace instead (PreemptionConfig.grace_s)")
    t.add_argument("--virtual-local-rank", "--virtual_local_rank", action="store_true",
                   help="LOCAL_RANK=0 for every worker, each seeing only its own GPU")

    o = p.add_argument_group("resilient-train's flags")
    o.add_argument("--run-dir", default="runs/latest", help="events.jsonl, final/ and checkpoints go here (default runs/latest)")
    o.add_argument("--spare", action="store_true",
                   help="a spare node: wait, then take over a lost node's ranks (many-node jobs)")
    o.add_argument("--job-token-file", default=None, metavar="PATH",
                   help="many nodes: a file (mode 600) holding the job's secret, the same on every node "
                        "(default: RT_JOB_TOKEN, else RUN_DIR/.job-token, made by the first agent)")
    o.add_argument("--node-timeout", type=number(above=0, high=MAX_SECONDS), default=10.0,
                   help="seconds without a node agent's beat before the node counts as lost (default 10)")
    o.add_argument("--max-replacements", type=integer(low=0), default=10,
                   help="in-place replacements of dead Supervisor ranks before giving up (default 10)")
    o.add_argument("--no-spare", action="store_true", help="do not keep warm spare workers (the same as --spares 0)")
    o.add_argument("--spares", type=integer(low=0, high=64), default=None,
                   help="warm spare interpreters this node keeps for its replacements (default 1; a --spare node "
                        "keeps one per local rank while it waits)")
    o.add_argument("--chaos", default="", help="JSON list of faults to inject (see the chaos package)")
    o.add_argument("--monitor-config", default=None,
                   help="YAML/JSON file with hang, straggler and metrics settings (see monitors.MonitorConfig)")
    o.add_argument("--dashboard", action="store_true",
                   help="serve the live dashboard of this job (prints its URL and control token; needs the dashboard extra)")
    o.add_argument("--dashboard-port", type=port, default=0, help="port of the dashboard (default 0: a free one)")
    o.add_argument("--dashboard-host", type=host("--dashboard-host"), default="127.0.0.1",
                   help="address the dashboard binds (default 127.0.0.1)")
    o.add_argument("--config", default=None, metavar="FILE",
                   help="the run config (YAML): every section and field, README 'Configuration'; torchrun's and "
                        "the flags above win over it, --SECTION.FIELD=VALUE over those")
    c = p.add_argument_group("the run config's fields", "--SECTION.FIELD=VALUE for any field of the run config, the "
                             "same names as in Python and YAML (python -m resilient_train.configdoc lists them)")
    for key, _, _ in RunConfig.keys():
        c.add_argument(f"--{key}", dest=f"{RC}{key}", type=_field_value(key), default=argparse.SUPPRESS,
                       metavar="VALUE", help=argparse.SUPPRESS)
    p.add_argument("script", nargs="?", default=None,
                   help="the training script (a module with -m, a program with --no-python; default: agent.script)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


RC = "rc:"  # the namespace's prefix for --SECTION.FIELD flags


def _field_value(key: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse_key_value(key, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _nnodes(value: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's syntax): (MIN, MAX)."""
    lo, _, hi = value.partition(":")
    try:
        n_min, n_max = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes {value!r}: expected N or MIN:MAX") from None
    if n_min < 1:
        raise ValueError(f"--nnodes {value}: at least one node")
    if n_min > n_max:
        raise ValueError(f"--nnodes {value}: MIN is more than MAX")
    return n_min, n_max


def _nproc(value: str) -> int:
    if value in ("auto", "gpu", "xpu"):
        try:
            import torch

            if value in ("auto", "gpu") and torch.cuda.is_available():
                return torch.cuda.device_count()
            if value == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
                return torch.xpu.device_count()
        except ImportError:
            pass
        if value != "auto":
            raise ValueError(f"--nproc-per-node {value}: no {value.upper()} on this machine")
        value = "cpu"
    if value == "cpu":
        return os.cpu_count() or 1
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--nproc-per-node {value!r}: expected a number, auto, cpu or gpu") from None


def _endpoint(value: str) -> tuple[str, int | None]:
    host, sep, port_text = value.rpartition(":") if value.count(":") == 1 or value.startswith("[") else ("", "", "")
    if not sep:
        return value.strip("[]"), None
    try:
        return host.strip("[]"), port(port_text)
    except argparse.ArgumentTypeError:
        raise ValueError(f"--rdzv-endpoint {value!r}: the port must be a number in [0, 65535]") from None


_BOOLS = frozenset({"1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"})  # torch's RendezvousParameters.get_as_bool
_RDZV_SECONDS = number(above=0, high=MAX_SECONDS, what="seconds")
_RDZV_CONF_VALUES = {"keep_alive_max_attempt": integer(low=1), "is_host": None, "use_libuv": None}


def _rdzv_conf(value: str) -> dict[str, str]:
    """torchrun's c10d keys, each value of its kind (seconds, a count, a bool), as torch reads them."""
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"--rdzv-conf: {item!r} is not KEY=VALUE")
        if key not in _RDZV_CONF_KEYS:
            raise ValueError(f"--rdzv-conf: unknown key {key!r} (known: {', '.join(_RDZV_CONF_KEYS)})")
        convert = _RDZV_CONF_VALUES.get(key, _RDZV_SECONDS)
        if convert is None:
            if v.strip().lower() not in _BOOLS:
                raise ValueError(f"--rdzv-conf: {key}={v!r}: expected a boolean (1/0, true/false, yes/no)")
        else:
            try:
                convert(v)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--rdzv-conf: {key}: {e}") from None
        conf[key] = v
    return conf


def _signals(value: str) -> tuple[str, ...]:
    names = tuple(s.strip().upper() for s in value.split(",") if s.strip())
    bad = [n for n in names if n not in _SIGNALS]
    if bad:
        raise ValueError(f"--signals-to-handle: unknown signal {bad[0]} (one of {', '.join(_SIGNALS)})")
    return names


def _entry(args: argparse.Namespace) -> Entry:
    if args.module and args.no_python:
        raise ValueError("-m and --no-python exclude each other")
    if args.module:
        return Entry(kind=EntryKind.MODULE, target=args.script)
    if args.no_python:
        program = args.script if os.sep in args.script else (shutil.which(args.script) or args.script)
        if not (Path(program).is_file() and os.access(program, os.X_OK)):
            raise ValueError(f"--no-python: {args.script!r} is not an executable program")
        return Entry(kind=EntryKind.PROGRAM, target=program)
    if not Path(args.script).is_file():
        raise ValueError(f"script {args.script!r} does not exist")
    return Entry(kind=EntryKind.SCRIPT, target=args.script)


def _refuse(args: argparse.Namespace) -> None:
    if args.event_log_handler != "null":
        raise ValueError(f"--event-log-handler {args.event_log_handler}: only 'null' (events go to RUN_DIR/events.jsonl)")
    if args.duplicate_stdout_filters or args.duplicate_stderr_filters:
        raise ValueError("--duplicate-stdout/stderr-filters: not supported (use --log-dir, --tee or --redirects)")
    if args.logs_specs is not None:
        raise ValueError("--logs-specs: log-spec plugins are not supported (use --log-dir)")
    if args.numa_binding is not None:
        raise ValueError("--numa-binding: not supported (workers are not bound to CPUs near their GPU)")
    if args.rdzv_backend not in _RDZV_BACKENDS:
        raise ValueError(f"--rdzv-backend {args.rdzv_backend}: only static or c10d (the agent hosts a c10d store)")


def agent_fields(args: argparse.Namespace, given: set[str], base: dict[str, Any]) -> dict[str, Any]:
    """The agent's fields that torchrun's and our flags set: those ``given`` on the command line, and what srun
    tells (where neither the flags nor the run config's agent section ``base`` say); plain data, checked once
    the whole config is built. ``ValueError`` with a one-line message for a bad flag."""
    _refuse(args)
    out: dict[str, Any] = {}
    spare = args.spare if "spare" in given else bool(base.get("spare", False))
    slurm = slurm_defaults(os.environ, spare=spare)
    for dest, name, read in (("nnodes", "nnodes", _nnodes), ("nproc_per_node", "nproc_per_node", _nproc),
                             ("node_rank", "node_rank", int), ("master_addr", "master_addr", str),
                             ("master_port", "master_port", int), ("rdzv_id", "run_id", str)):
        if dest in given:
            out[name] = read(getattr(args, dest))
            if dest == "nnodes":
                out["min_nodes"], out["nnodes"] = out["nnodes"]
                if out["min_nodes"] == out["nnodes"]:
                    del out["min_nodes"]
        elif name not in base and name in slurm:
            out[name] = slurm[name] if name != "nnodes" else int(slurm[name])  # type: ignore[call-overload]
    if "master_port" in out:
        out["fixed_port"] = out["master_port"] != 0
    if args.standalone and out.get("nnodes", base.get("nnodes", 1)) != 1:
        raise ValueError("--standalone is for one node: give --nnodes 1, or --master-addr/--master-port")
    if args.standalone:
        # torchrun: a c10d store on a free local port, a random id; --rdzv-* are ignored.
        out.update(master_addr="127.0.0.1", master_port=0, fixed_port=False, run_id=str(uuid.uuid4()))
    elif args.rdzv_endpoint:
        endpoint_host, endpoint_port = _endpoint(args.rdzv_endpoint)
        out["master_addr"] = endpoint_host or out.get("master_addr", base.get("master_addr", "127.0.0.1"))
        out["master_port"] = endpoint_port if endpoint_port is not None else C10D_DEFAULT_PORT
        out["fixed_port"] = True
    if "master_addr" in out:
        check_host(out["master_addr"], "--rdzv-endpoint" if args.rdzv_endpoint and not args.standalone
                   else "--master-addr")
    conf = _rdzv_conf(args.rdzv_conf)
    for key, name in (("last_call_timeout", "last_call_s"), ("join_timeout", "join_timeout_s")):
        if key in conf:  # an elastic job's start (resilient_train.agent.width); the others are accepted only
            out[name] = float(conf[key])
    nproc = out.get("nproc_per_node", base.get("nproc_per_node", 1))
    nproc = nproc if isinstance(nproc, int) and not isinstance(nproc, bool) else 1
    output: dict[str, Any] = {}
    if "log_dir" in given:
        output["log_dir"] = args.log_dir
    if "redirects" in given:
        output["redirects"] = {r: int(v) for r, v in parse_std_streams(args.redirects, nproc, "--redirects").items()}
    if "tee" in given:
        output["tee"] = {r: int(v) for r, v in parse_std_streams(args.tee, nproc, "--tee").items()}
    if "local_ranks_filter" in given:
        ranks = _ranks_filter(args.local_ranks_filter, nproc)
        output["local_ranks_filter"] = None if ranks is None else sorted(ranks)
    if "role" in given:
        out["role"] = output["role"] = args.role
    if output:
        out["output"] = output
    if args.script is not None:
        entry = _entry(args)
        out.update(script=entry.target, entry={"kind": entry.kind.value, "target": entry.target},
                   script_args=list(args.script_args))
    elif args.module or args.no_python:
        raise ValueError("-m and --no-python name how SCRIPT runs: give SCRIPT")
    for dest, name, read in (("max_restarts", "max_restarts", None), ("monitor_interval", "monitor_interval_s", None),
                             ("run_dir", "run_dir", None), ("spare", "spare", None),
                             ("job_token_file", "job_token_file", _token_file), ("node_timeout", "node_timeout_s", None),
                             ("max_replacements", "max_replacements", None), ("spares", "spares", None),
                             ("chaos", "chaos", None), ("signals_to_handle", "signals", _signals),
                             ("shutdown_timeout", "shutdown_timeout_s", None),
                             ("virtual_local_rank", "virtual_local_rank", None)):
        if dest in given:
            value = getattr(args, dest)
            out[name] = read(value) if read is not None else value
    if "signals" in out:
        out["signals"] = list(out["signals"])
    if args.no_spare:
        out["warm_spare"] = False
    return out


def _token_file(path: str | None) -> str | None:
    """``--job-token-file``, read now: a bad one is one line before anything starts (resilient_train.protocol.jobtoken)."""
    if path is not None:
        read_token_file(path, "--job-token-file")
    return path


def _ranks_filter(value: str, nproc: int) -> frozenset[int] | None:
    if not value:
        return None
    try:
        ranks = frozenset(int(s) for s in value.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--local-ranks-filter {value!r}: expected local ranks, e.g. 0,2") from None
    bad = sorted(r for r in ranks if not 0 <= r < nproc)
    if bad:
        raise ValueError(f"--local-ranks-filter: local rank {bad[0]} is not in [0, {nproc})")
    return ranks
