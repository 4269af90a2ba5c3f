"""What Slurm tells each task of a step, read once: the agent's node flags and the job's identity.

Under ``srun`` every task has the job's node count, its own node index, the
job's node list and the job id in its environment; the agent takes its node
flags from them where the command line and the run config say nothing
(:func:`slurm_defaults`). A job that requeued itself runs again under the
same id with ``SLURM_RESTART_COUNT`` raised; the agent records it in its
``agent_start`` event (:func:`slurm_job`), so a run directory shows each
start of the job and which requeue it was.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SLURM_PORT_BASE", "first_host", "slurm_defaults", "slurm_job"]

SLURM_PORT_BASE = 29500  # under srun without --master-port: 29500 + the job id's last three digits


def slurm_defaults(environ: Mapping[str, str], *, spare: bool = False) -> dict[str, object]:
    """What ``srun`` tells each task: nodes, this node's index, the first host as node 0, the job id.

    Flags given on the command line win over these. A spare node (``--spare``) takes no node rank from
    ``SLURM_NODEID``: it has none until it takes over a lost node's, and its index in the allocation is past
    the job's nodes (the template's spare nodes are the allocation's last ones).
    """
    if "SLURM_JOB_ID" not in environ or "SLURM_NODEID" not in environ:
        return {}
    out: dict[str, object] = {"run_id": f"slurm-{environ['SLURM_JOB_ID']}"}
    if not spare:
        out["node_rank"] = int(environ["SLURM_NODEID"])
    nnodes = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
    if nnodes:
        out["nnodes"] = int(nnodes)
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        out["master_addr"] = first_host(nodelist)
    out["master_port"] = SLURM_PORT_BASE + int(environ["SLURM_JOB_ID"]) % 1000
    return out


def slurm_job(environ: Mapping[str, str]) -> dict[str, object]:
    """The job id and how many times Slurm started it before (0 at the first start, 1 after one requeue),
    as ``agent_start``'s fields; nothing outside a Slurm job."""
    if "SLURM_JOB_ID" not in environ:
        return {}
    restarts = environ.get("SLURM_RESTART_COUNT") or "0"  # unset at a job's first start
    return {"slurm_job_id": environ["SLURM_JOB_ID"], "slurm_restart_count": int(restarts)}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, _, ranges = head.partition("[")
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first
