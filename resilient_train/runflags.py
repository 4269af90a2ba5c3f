"""``resilient-train run``'s run config, in layers: the file, then torchrun's and our flags, then ``--SECTION.FIELD``.

Each layer wins over the one before it, field by field:

1. the fields' defaults (``python -m resilient_train.configdoc``), with
   ``RT_REPRODUCIBLE=1`` and ``RT_FORCE_REDUCTION=1`` in the agent's environment
   setting ``supervisor.reproducible`` and ``supervisor.force_reduction``
   (the chaos runner's bitwise verdicts; benchmarks);
2. ``--config FILE`` (YAML, every section);
3. srun's environment (nodes, node rank, node 0, the job id), where the file
   does not say;
4. the flags given on the command line: torchrun's (``--nproc-per-node``,
   ``--max-restarts``, ...), ``--monitor-config FILE`` (the ``monitors``
   section's keys it holds), ``--dashboard`` and the others of ours;
5. ``--SECTION.FIELD=VALUE``.

A flag left out sets nothing: only what is typed counts (its default is the
field's). The result is checked once, as a whole; a mistake is one line.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from monitors import MonitorConfig
from resilient_train.base.configfile import load_config_file
from resilient_train.base.configtree import set_key
from resilient_train.protocol import env as envvars
from resilient_train.launch import RC, add_run_arguments, agent_fields
from resilient_train.runconfig import RunConfig

__all__ = ["given_flags", "run_config"]


def given_flags(argv: list[str]) -> set[str]:
    """The destinations of the flags (and the positional) that ``argv`` (``run``'s own arguments) gives."""
    from resilient_train.base.cliargs import OneLineParser

    p = OneLineParser(prog="resilient-train run", add_help=False)
    add_run_arguments(p)
    for action in p._actions:
        action.default = argparse.SUPPRESS
        action.type = None  # checked by the first parse; here only what is there counts
    ns, _ = p.parse_known_args(argv)
    return set(vars(ns))


def run_config(args: argparse.Namespace, argv: list[str]) -> RunConfig:
    """The run config of ``resilient-train run`` ``argv`` (already parsed into ``args``)."""
    given = given_flags(argv)
    data: dict[str, Any] = {}
    if args.config is not None:
        loaded = load_config_file(args.config, "--config")
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"--config {args.config!r}: must be a mapping of sections, got {type(loaded).__name__}")
        data = dict(loaded or {})
    _environment_defaults(data)
    base = data.get("agent")
    base = dict(base) if isinstance(base, dict) else ({} if base is None else base)
    if isinstance(base, dict):
        for name, value in agent_fields(args, given, base).items():
            if name == "output" and isinstance(base.get("output"), dict):
                value = {**base["output"], **value}
            base[name] = value
    data["agent"] = base
    if args.monitor_config is not None:  # checked by itself first, then laid over the section
        try:
            MonitorConfig.load(args.monitor_config)
        except ValueError as e:
            raise ValueError(f"--monitor-config: {e}") from None
        data["monitors"] = _merged(data.get("monitors"), load_config_file(args.monitor_config, "monitor config") or {})
    if args.dashboard or (isinstance(data.get("dashboard"), dict) and given & {"dashboard_host", "dashboard_port"}):
        dashboard = dict(data.get("dashboard") or {})
        if "dashboard_host" in given or "host" not in dashboard:
            dashboard["host"] = args.dashboard_host
        if "dashboard_port" in given or "port" not in dashboard:
            dashboard["port"] = args.dashboard_port
        data["dashboard"] = dashboard
    for dest in sorted(d for d in given if d.startswith(RC)):
        set_key(data, dest[len(RC):], getattr(args, dest))
    label = f"--config {args.config!r}" if args.config is not None else "run config"
    return RunConfig.from_dict(data, label=label)


def _merged(under: Any, over: dict[str, Any]) -> Any:
    """``over`` laid over ``under``, mapping by mapping."""
    if not isinstance(under, dict):
        return over
    out = dict(under)
    for k, v in over.items():
        out[k] = _merged(out.get(k), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _environment_defaults(data: dict[str, Any]) -> None:
    """``RT_REPRODUCIBLE=1`` / ``RT_FORCE_REDUCTION=1``: the supervisor's field, where the file does not say."""
    for variable, name in ((envvars.RT_REPRODUCIBLE, "reproducible"), (envvars.RT_FORCE_REDUCTION, "force_reduction")):
        section = data.get("supervisor")
        if os.environ.get(variable) == "1" and (section is None or isinstance(section, dict)):
            if name not in (section or {}):
                data["supervisor"] = {**(section or {}), name: True}
