"""The node agent behind ``resilient-train run``: one policy per module, one state value, one loop.

==================  ==========================================================
module              policy
==================  ==========================================================
``config``          :class:`AgentConfig` and its checks
``state``           :class:`AgentState`, its transition table, how the agent ends
``events``          what the pollers report, and the decisions, as data
``decide``          each event to one decision (reads nothing, acts on nothing)
``storehost``       hosting, reaching and re-hosting the coordination store
``workers``         the worker table: environment, spawn (warm spares), exits
``recovery``        a dead worker: replaced in place, or every worker restarted
``hangs``           the kill policy for hung ranks and stragglers, stack dumps
``monitorstate``    the computed hang timeouts saved, loaded and offered
``membership``      many nodes: beats, lost nodes and their fence, spare nodes
``signals``         the forwarded signals, caught as events
``ending``          shutdown, a rank's stop, success, fenced, leaving the job
``loop``            :class:`Agent`: the policies composed, and the loop
==================  ==========================================================

Beside them, the agent's helpers: its warm spares (``spares``; ``spare``, the
spare's own process), what a worker runs (``entry``), the workers' output
(``workerio``, ``console``, ``outcut``, ``nativelog``), when a whole-job
restart happens (``restarts``), the run directory (``rundir``), Slurm's
environment (``slurmenv``) and the store host's open-file limit (``fdlimit``).

The names below are imported when first used: a warm spare, whose module is
here, loads nothing of the agent at its boot, and a rank that reads the run's
config (``AgentConfig``) does not load the agent's loop.
"""

from typing import TYPE_CHECKING

from resilient_train.base.lazynames import lazy_names

__all__ = ["Agent", "AgentConfig", "AgentError", "AgentState", "AgentStopped", "WorkerState"]

_LAZY = {
    "Agent": "resilient_train.agent.loop",
    "AgentConfig": "resilient_train.agent.config",
    "AgentError": "resilient_train.agent.state",
    "AgentState": "resilient_train.agent.state",
    "AgentStopped": "resilient_train.agent.state",
    "WorkerState": "resilient_train.agent.workers",
}

if TYPE_CHECKING:
    from resilient_train.agent.config import AgentConfig
    from resilient_train.agent.loop import Agent
    from resilient_train.agent.state import AgentError, AgentState, AgentStopped
    from resilient_train.agent.workers import WorkerState

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
