"""``resilient-train``: the command line.

    resilient-train run [options] SCRIPT [ARGS...]   run a training script under the node agent
    resilient-train demo                             kill and break ranks of a small GPT job, show the recovery
    resilient-train ckpt {ls,verify,inspect,diff}    checkpoints and final states
    resilient-train status RUN_DIR                   summary of a live or finished run
    resilient-train straggler RUN_DIR [--on|--off] [--threshold X]   steer straggler detection at run time
    resilient-train dashboard RUN_DIR [--port P] [--host H] [--export FILE]   the live straggler and recovery page
    resilient-train chaos {run,matrix,plan,list}    prove that a job survives faults
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from resilient_train.base.exitfast import end_process, skip_final_collection

if TYPE_CHECKING:
    from resilient_train.agent import AgentConfig

__all__ = ["entry", "main"]


def _run_parser(sub: argparse._SubParsersAction) -> None:
    from resilient_train.launch import add_run_arguments

    p = sub.add_parser(
        "run", help="run a training script under the node agent (torchrun's flags work)",
        description="Run SCRIPT on --nproc-per-node ranks with torchrun's environment and flags; "
        "replace Supervisor ranks that die in place, restart plain scripts as torchrun does.",
    )
    add_run_arguments(p)


def _cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    import warnings

    from resilient_train.protocol.env import RT_RUN_CONFIG
    from resilient_train.agent import Agent, AgentError
    from resilient_train.agent.console import Std
    from resilient_train.agent.nativelog import FoldedStderr
    from resilient_train.preflight import check_run_inputs
    from resilient_train.runflags import run_config

    # Every bad flag or field is one line and exit 2 here, before any worker starts.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        run = run_config(args, argv)
    for w in caught:  # an old field name in a file: one line each, the run goes on
        print(f"resilient-train: warning: {w.message}", file=sys.stderr)
    config = run.agent
    if config.entry is None:
        raise ValueError("no script to run: give SCRIPT (or agent.script in --config)")
    check_run_inputs(nproc_per_node=config.nproc_per_node, nnodes=config.nnodes, chaos=config.chaos,
                     monitor_config=None, log_dir=config.output.log_dir)
    try:
        agent = Agent(config)
    except AgentError as e:  # bad input: a port in use, a run directory that is not writable
        print(f"resilient-train: error: {e}", file=sys.stderr)
        return 2
    # The effective config, for the record and for the ranks, whose scripts take it with
    # SupervisorConfig.from_run_config (RT_RUN_CONFIG, set for every worker spawned after this).
    path = run.write(agent.run_dir / run_config_name(config))
    config.env[RT_RUN_CONFIG] = str(path.resolve())
    # c10d's C++ warnings from the agent's own store connections, one per connection when node 0 goes, each
    # with a C++ stack: the agent says what happened in one line instead (resilient_train.agent.nativelog).
    # A stderr that closes under the agent (2>&1 | head) is the console's to handle (resilient_train.agent.console).
    folded = FoldedStderr(on_closed=lambda: agent.console.closed(Std.ERR))
    with folded:
        try:
            return agent.run()
        except AgentError as e:  # the run gave up
            agent.console.write(f"resilient-train: {e}\n".encode())
            return e.exit_code
        finally:
            if agent.console.is_closed(Std.ERR):
                folded.closed()  # fd 2 becomes /dev/null: nothing said after this can raise


def run_config_name(config: "AgentConfig") -> str:
    """Node 0's agent writes RUN_DIR/run-config.yaml; the others (a shared run directory) their own."""
    from resilient_train.runconfig import RUN_CONFIG_FILE

    if config.spare:
        return f"run-config.spare-{os.getpid()}.yaml"
    return RUN_CONFIG_FILE if config.node_rank == 0 else f"run-config.node{config.node_rank}.yaml"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    skip_final_collection()
    # Subcommands owned by other packages take their own arguments.
    if argv[:1] == ["ckpt"]:
        from checkpointing.cli import main as ckpt_main

        return ckpt_main(argv[1:])
    if argv[:1] == ["status"]:
        from monitors.cli import status_main

        return status_main(argv[1:])
    if argv[:1] == ["straggler"]:
        from monitors.cli import straggler_main

        return straggler_main(argv[1:])
    if argv[:1] == ["dashboard"]:
        from monitors.dashboard.cli import dashboard_main

        return dashboard_main(argv[1:])
    if argv[:1] == ["chaos"]:
        from chaos.cli import main as chaos_main

        return chaos_main(argv[1:])
    from resilient_train.base.cliargs import OneLineParser, integer

    parser = OneLineParser(prog="resilient-train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _run_parser(sub)
    demo = sub.add_parser("demo", help="a 4-rank GPT job with a killed and a failing rank, compared with a fault-free run")
    demo.add_argument("--steps", type=integer(low=1), default=60, help="training steps (default 60)")
    demo.add_argument("--nproc-per-node", type=integer(low=1), default=4, help="ranks (default 4)")
    demo.add_argument("--run-dir", default="runs/demo", help="where the two runs go (default runs/demo)")
    sub.add_parser("ckpt", help="list, verify, inspect and diff checkpoints (see: resilient-train ckpt --help)")
    sub.add_parser("status", help="summary of a live or finished run (see: resilient-train status --help)")
    sub.add_parser("straggler", help="switch straggler detection of a running job on/off, or set its threshold")
    sub.add_parser("dashboard", help="the live straggler and recovery page of a run, or --export it to one HTML file")
    sub.add_parser("chaos", help="run chaos scenarios and the fault matrix (see: resilient-train chaos --help)")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _cmd_run(args, argv[1:])
        if args.command == "demo":
            from resilient_train.demo import run_demo

            return run_demo(steps=args.steps, nproc=args.nproc_per_node, run_dir=args.run_dir)
    except ValueError as e:
        print(f"resilient-train: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


def entry() -> None:
    """The ``resilient-train`` command: ``main``'s code is the process's, whatever threads are still in a call
    (resilient_train.base.exitfast.end_process: an agent cut off from its store)."""
    end_process(main())


if __name__ == "__main__":
    entry()
