"""The PyTorch runtime: ``dtr.budget`` (a TorchDispatchMode over the C++ core)."""
from dtr.runtime.budget import Budget, budget

__all__ = ["Budget", "budget"]
