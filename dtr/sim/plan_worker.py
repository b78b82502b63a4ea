"""Plan a recorded step in its own process: ``python -m dtr.sim.plan_worker LOG BUDGET PLANNER SECONDS [OVERHEAD] OUT``.

``dtr.budget(..., plan=True)`` runs it off the training step's critical path
(Note [Planning off the critical path] in dtr/runtime/step_plans.py). It
imports the simulator only (no torch), writes the plan as JSON to OUT
(:func:`dtr.sim.step_plan.save_step_plan`) and exits 0, or exits 2 with the
error on stderr. OVERHEAD is the cost charged per recomputation
(``make_step_plan``'s ``remat_overhead``, in the log's unit; 0 if left out).
"""
from __future__ import annotations

import sys
from typing import List, Optional

from dtr.errors import DtrError
from dtr.sim.step_plan import make_step_plan, save_step_plan

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the worker; see the module's docstring."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (5, 6):
        print("usage: python -m dtr.sim.plan_worker LOG BUDGET PLANNER SECONDS [OVERHEAD] OUT", file=sys.stderr)
        return 2
    log, budget, planner, seconds, *overhead, out = args
    try:
        plan = make_step_plan(log, int(budget), planner, time_limit=float(seconds), later_steps=True,
                              remat_overhead=float(overhead[0]) if overhead else 0.0)
        save_step_plan(plan, out)
    except (DtrError, ValueError, OSError) as e:
        print(f"dtr.sim.plan_worker: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
