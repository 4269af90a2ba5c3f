"""The node agent behind ``resilient-train run``: one policy per module, one state value, one loop.

==================  ==========================================================
module              policy
==================  ==========================================================
``config``          :class:`AgentConfig` and its checks
``state``           :class:`AgentState`, its transition table, how the agent ends
``events``          what the pollers report, and the decisions, as data
``decide``          each event to one decision (reads nothing, acts on nothing)
``storehost``       hosting, reaching and re-hosting the coordination store
``boundedstore``    every store call of a node other than 0 ends by a deadline
``workers``         the worker table: environment, spawn (warm spares), exits
``recovery``        a dead worker: replaced in place, or every worker restarted
``hangs``           the kill policy for hung ranks and stragglers, stack dumps
``monitorstate``    the computed hang timeouts saved, loaded and offered
``membership``      many nodes: beats, lost nodes and their fence, spare nodes
``signals``         the forwarded signals, caught as events
``ending``          shutdown, a rank's stop, success, fenced, leaving the job
``loop``            :class:`Agent`: the policies composed, and the loop
==================  ==========================================================
"""

from resilient_train.agent.config import AgentConfig
from resilient_train.agent.loop import Agent
from resilient_train.agent.state import AgentError, AgentState, AgentStopped
from resilient_train.agent.workers import WorkerState

__all__ = ["Agent", "AgentConfig", "AgentError", "AgentState", "AgentStopped", "WorkerState"]
