"""The PyTorch runtime: ``dtr.budget`` (a TorchDispatchMode over the C++ core)."""
from dtr.runtime.budget import Budget, active_budget, budget

__all__ = ["Budget", "active_budget", "budget"]
