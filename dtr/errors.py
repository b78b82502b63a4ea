"""Exceptions that dtr raises for user errors and infeasible runs."""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["DtrError", "LogFormatError", "BudgetError", "OutOfBudgetError", "ThrashingError", "NestingError",
           "BudgetWarning"]


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
        report: what filled the budget (a :class:`dtr.budget_report.BudgetReport`:
            every resident storage and why it could not be evicted, the op that
            was about to run), or None where the failure has no such report.
        detail: what dtr was doing, in words ("" when the report says it).
    """

    def __init__(self, budget: int, needed: int, detail: str = "", report: Any = None):
        self.budget, self.needed = int(budget), int(needed)
        self.detail, self.report = detail, report
        super().__init__(self._message())

    def _message(self) -> str:
        msg = (f"out of budget: {self.needed} bytes had to be resident at once, "
               f"but the budget is {self.budget} bytes; raise the budget to at least {self.needed} bytes")
        msg += f" ({self.detail})" if self.detail else ""
        return msg + ("\n" + self.report.describe() if self.report is not None else "")

    def with_report(self, report: Any, detail: Optional[str] = None) -> "OutOfBudgetError":
        """This error with ``report`` (and ``detail``, if given) in place of its own; its message follows."""
        self.report = report
        if detail is not None:
            self.detail = detail
        self.args = (self._message(),)
        return self


class ThrashingError(DtrError, RuntimeError):
    """Rematerialization passed the thrash limit, in compute or in the number of recomputations.

    Attributes:
        remat_compute: recomputation compute so far; ``limit`` what the thrash limit allowed of it.
        remats: recomputations so far; ``count_limit`` how many the thrash limit allowed (None: not counted).
        detail: what dtr was doing, in words.
    """

    def __init__(self, remat_compute: float, limit: float, detail: str = "", remats: Optional[int] = None,
                 count_limit: Optional[int] = None):
        self.remat_compute, self.limit = float(remat_compute), float(limit)
        self.remats, self.count_limit = remats, count_limit
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        if self.remats is not None and self.count_limit is not None and self.remats > self.count_limit:
            msg = (f"thrashing: {self.remats} recomputations passed the limit of {self.count_limit} "
                   f"(recomputation compute {self.remat_compute:g}, allowed {self.limit:g})")
        else:
            msg = (f"thrashing: rematerialization compute {self.remat_compute:g} passed the limit {self.limit:g}"
                   + (f" ({self.remats} recomputations)" if self.remats is not None else ""))
        msg += "; raise the budget or the thrash limit"
        return msg + (f" ({self.detail})" if self.detail else "")

    def with_detail(self, detail: str) -> "ThrashingError":
        """This error saying what dtr was doing; its message follows."""
        self.detail = detail
        self.args = (self._message(),)
        return self


class NestingError(DtrError, RuntimeError):
    """A ``dtr.budget`` block inside another cannot do what it was asked (an option the outer block fixes)."""


class BudgetWarning(UserWarning):
    """A ``dtr.budget`` block could not give the program back all of its tensors.

    Issued when a block left by an exception could not bring back the tensors
    the program holds (a recomputation failed too): those dtr had evicted
    have no bytes and must not be used.
    """
