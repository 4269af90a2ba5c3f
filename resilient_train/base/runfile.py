"""The run config file the agent hands its ranks: ``RT_RUN_CONFIG`` names it (``RUN_DIR/run-config.yaml``).

No config class reads it: a config object is what its constructor was given.
The file reaches a rank in one place, when the script asks for it
(``SupervisorConfig.from_run_config(...)``, or ``rt.Supervisor()`` with no
config), which reads it with :func:`read_run_file`. A variable that names no
run config (one left in a user's shell) is one line naming it
(:class:`~resilient_train.base.configtree.RunConfigVariableError`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from resilient_train.base.configfile import kind, load_config_file
from resilient_train.base.configtree import RT_RUN_CONFIG, RunConfigVariableError

__all__ = ["read_run_file"]

# The agent sets the variable for its ranks; one left in a user's shell is the usual way to meet a bad one.
_UNSET = f" (the agent sets ${RT_RUN_CONFIG} for its ranks: unset it to run without)"


def read_run_file(path: str | os.PathLike[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The plain data of the run config at ``path``, else of the file ``RT_RUN_CONFIG`` names; ``None`` when
    neither names one (a script outside the agent)."""
    named = path is not None
    if path is None:
        path = (os.environ if environ is None else environ).get(RT_RUN_CONFIG) or None
    if path is None:
        return None
    label = "run config" if named else f"run config ${RT_RUN_CONFIG}"
    hint = "" if named else _UNSET
    try:
        os.stat(path)
    except OSError as e:
        raise RunConfigVariableError(f"{label} {str(path)!r} cannot be read: {e.strerror or e}{hint}") from None
    try:
        data = load_config_file(path, "run config" if named else f"run config (${RT_RUN_CONFIG})")
    except ValueError as e:
        raise RunConfigVariableError(f"{e}{hint}") from None
    if data is not None and not isinstance(data, dict):
        raise RunConfigVariableError(f"{label} {str(path)!r} must be a mapping of sections, got {kind(data)}{hint}")
    return data or {}
