"""Budget errors in the runtime's terms: the core reports ids, the program's user wants op names.

An :class:`~dtr.OutOfBudgetError` from the core carries a
:class:`~dtr.budget_report.BudgetReport` of what was resident and why it could
not be evicted (the core's Note [What filled the budget] in
csrc/core_evict.cpp), with the core's ids of the op being begun and the op
being recomputed. :func:`name_failure` names them once, where the error leaves
an op: ReferencePath._dispatch for the reference, and the native per-op
path (csrc/native/fastpath.cpp, mode_torch_dispatch, calls it for both of its entries). The error
keeps its type and its data; only its message grows.
"""
from __future__ import annotations

from typing import Any, Optional

from dtr.errors import OutOfBudgetError, ThrashingError

__all__ = ["name_failure", "op_name", "recomputed_op_name"]


def op_name(func: Any) -> str:
    """An op as a user reads it: ``aten::mm`` for an ATen overload, else its ``str``."""
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


def recomputed_op_name(mode: Any, op: int) -> Optional[str]:
    """The name of core op ``op`` as the block's recipe of it has it (None: no such recipe, or ``op`` < 0)."""
    recipe = mode.recomputer.recipes.get(op) if op >= 0 else None
    return op_name(recipe.func) if recipe is not None else None


def name_failure(mode: Any, exc: BaseException, what: Any) -> None:
    """Say in ``exc`` what dtr was doing when it failed, if nothing said so yet.

    Args:
        mode: the block's Driver (its recipes name the recomputed op).
        exc: the error; only an OutOfBudgetError or a ThrashingError is changed.
        what: the op that was about to run (an OpOverload, named ``aten::...``),
            or a description of what dtr was doing (a str).
    """
    op, doing = (None, what) if isinstance(what, str) else (op_name(what), None)
    if isinstance(exc, OutOfBudgetError):
        report = exc.report
        if report is not None and report.op is None and report.doing is None:
            exc.with_report(report.named(op, recomputed_op_name(mode, report.remat_op_id), doing))
        elif report is None and not exc.detail:
            exc.with_report(None, f"while running {op}" if op is not None else f"while {doing}")
    elif isinstance(exc, ThrashingError) and not exc.detail:
        exc.with_detail(f"while running {op}" if op is not None else f"while {doing}")
