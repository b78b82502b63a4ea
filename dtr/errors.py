"""Exceptions that dtr raises for user errors and infeasible runs."""
from __future__ import annotations

__all__ = ["DtrError", "LogFormatError", "BudgetError", "OutOfBudgetError", "ThrashingError", "BudgetWarning"]


class DtrError(Exception):
    """Base class of dtr's own errors."""


class LogFormatError(DtrError, ValueError):
    """A malformed or inconsistent line in an operator log.

    Attributes:
        path: the log file.
        line: 1-based line number (0 when the error is about the whole file).
        reason: what is wrong with that line.
    """

    def __init__(self, path: str, line: int, reason: str):
        self.path, self.line, self.reason = str(path), int(line), reason
        where = f"{self.path}:{self.line}" if self.line > 0 else self.path
        super().__init__(f"{where}: {reason}")


class BudgetError(DtrError, ValueError):
    """A budget that cannot be parsed (e.g. ``"6 parsecs"``)."""


class OutOfBudgetError(DtrError, MemoryError):
    """No eviction can make room within the budget.

    Attributes:
        budget: the budget in bytes.
        needed: bytes that had to be resident at the moment it failed (a lower
            bound on the budget this run needs).
    """

    def __init__(self, budget: int, needed: int, detail: str = ""):
        self.budget, self.needed = int(budget), int(needed)
        msg = (f"out of budget: {self.needed} bytes had to be resident at once, "
               f"but the budget is {self.budget} bytes; raise the budget to at least {self.needed} bytes")
        super().__init__(msg + (f" ({detail})" if detail else ""))


class ThrashingError(DtrError, RuntimeError):
    """Rematerialization compute passed the thrash limit."""

    def __init__(self, remat_compute: float, limit: float, detail: str = ""):
        self.remat_compute, self.limit = float(remat_compute), float(limit)
        msg = (f"thrashing: rematerialization compute {self.remat_compute:g} passed the limit {self.limit:g}; "
               f"raise the budget or the thrash limit")
        super().__init__(msg + (f" ({detail})" if detail else ""))


class BudgetWarning(UserWarning):
    """A ``dtr.budget`` block could not give the program back all of its tensors.

    Issued when a block left by an exception could not bring back the tensors
    the program holds (a recomputation failed too): those dtr had evicted
    have no bytes and must not be used.
    """
