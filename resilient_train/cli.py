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
import sys

__all__ = ["main"]


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run a training script under the node agent",
        description="Run SCRIPT on --nproc-per-node ranks with torchrun's environment; "
        "replace ranks that die and recover in place.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="worker processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (only 1 for now)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's rank (default 0)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="address of the coordination store (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=0, help="port of the coordination store (default 0: a free one)")
    p.add_argument("--run-dir", default="runs/latest", help="events.jsonl, final/ and checkpoints go here (default runs/latest)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=10, help="rank replacements before giving up (default 10)")
    p.add_argument("--no-spare", action="store_true", help="do not keep a warm spare worker")
    p.add_argument("--chaos", default="", help="JSON list of faults to inject (see the chaos package)")
    p.add_argument("--monitor-config", default=None,
                   help="YAML/JSON file with hang, straggler and metrics settings (see monitors.MonitorConfig)")
    p.add_argument("--dashboard", action="store_true",
                   help="serve the live dashboard of this job (prints its URL and control token; "
                        "needs the dashboard extra)")
    p.add_argument("--dashboard-port", type=int, default=0, help="port of the dashboard (default 0: a free one)")
    p.add_argument("--dashboard-host", default="127.0.0.1", help="address the dashboard binds (default 127.0.0.1)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _cmd_run(args: argparse.Namespace) -> int:
    from resilient_train.agent import Agent, AgentConfig, AgentError
    from monitors.dashboard.server import DashboardConfig
    from resilient_train.preflight import check_run_inputs

    # Every bad flag is one line and exit 2 here, before any worker starts.
    monitor = check_run_inputs(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, chaos=args.chaos,
                               monitor_config=args.monitor_config)
    config = AgentConfig(
        script=args.script, script_args=args.script_args, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port, run_dir=args.run_dir,
        max_restarts=args.max_restarts, warm_spare=not args.no_spare, chaos=args.chaos,
        dashboard=DashboardConfig(host=args.dashboard_host, port=args.dashboard_port) if args.dashboard else None,
        **({"monitor": monitor} if monitor is not None else {}),
    )
    try:
        agent = Agent(config)
    except AgentError as e:  # bad input: a port in use, a run directory that is not writable
        print(f"resilient-train: error: {e}", file=sys.stderr)
        return 2
    try:
        return agent.run()
    except AgentError as e:  # the run gave up
        print(f"resilient-train: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
    parser = argparse.ArgumentParser(prog="resilient-train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _run_parser(sub)
    demo = sub.add_parser("demo", help="a 4-rank GPT job with a killed and a failing rank, compared with a fault-free run")
    demo.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    demo.add_argument("--nproc-per-node", type=int, default=4, help="ranks (default 4)")
    demo.add_argument("--run-dir", default="runs/demo", help="where the two runs go (default runs/demo)")
    sub.add_parser("ckpt", help="list, verify, inspect and diff checkpoints (see: resilient-train ckpt --help)")
    sub.add_parser("status", help="summary of a live or finished run (see: resilient-train status --help)")
    sub.add_parser("straggler", help="switch straggler detection of a running job on/off, or set its threshold")
    sub.add_parser("dashboard", help="the live straggler and recovery page of a run, or --export it to one HTML file")
    sub.add_parser("chaos", help="run chaos scenarios and the fault matrix (see: resilient-train chaos --help)")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "demo":
            from resilient_train.demo import run_demo

            return run_demo(steps=args.steps, nproc=args.nproc_per_node, run_dir=args.run_dir)
    except ValueError as e:
        print(f"resilient-train: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
