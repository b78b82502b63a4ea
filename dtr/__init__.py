"""dtr: Dynamic Tensor Rematerialization for PyTorch.

``with dtr.budget("6GiB"): train_step()`` runs a training step within a memory
budget by evicting tensors and recomputing them on demand. ``dtr-sim`` replays
recorded operator logs offline.

Importing dtr is light: the runtime (and torch) load on first use of
:func:`budget`.
"""
from __future__ import annotations

from typing import Any

from dtr.errors import BudgetWarning, DtrError, LogFormatError, NestingError, OutOfBudgetError, ThrashingError
from dtr.heuristics import Heuristic, heuristic_names, register_heuristic
from dtr.units import parse_bytes

__all__ = ["budget", "active_budget", "DtrError", "LogFormatError", "OutOfBudgetError", "ThrashingError",
           "NestingError", "BudgetWarning", "Heuristic", "heuristic_names", "register_heuristic", "parse_bytes"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Note [Lazy runtime]: the runtime imports torch; the simulator must not.
    if name == "budget":
        from dtr.runtime.budget import budget
        return budget
    if name == "active_budget":
        from dtr.runtime.budget import active_budget
        return active_budget
    raise AttributeError(f"module 'dtr' has no attribute {name!r}")
