"""Static rematerialization planners, registered by name.

A planner takes the planning graph (:class:`dtr.sim.graph.PlanGraph`) and a
budget in bytes, and returns a compute sequence of nodes (a node may appear
several times: recomputation); :func:`dtr.sim.schedule.plan_schedule` turns it
into a schedule with frees, and :func:`dtr.sim.schedule.evaluate` checks it.
Planners never import numpy or scipy at module import time.

Registered: ``chen`` (sqrt(n) segments / greedy), ``rotor`` (dynamic
programming on forward-backward chains), ``lookahead`` (on-demand evictions
chosen with the future known), ``checkmate`` (the ILP on HiGHS),
``checkmate-lp`` (its LP relaxation with randomized rounding), ``fastsa``
(simulated annealing), ``hierarchical`` (Rockmate-style: a chain of parts,
exact options per part, a DP over the chain).

The shared definitions (options, results, the registry) live in
:mod:`dtr.sim.planners.base`, which imports no planner; this package imports
it, then every planner, and re-exports its public names.
"""
from __future__ import annotations

# The shared definitions first; then the planners, which register themselves on import (they import
# numpy/scipy lazily), in the order of planner_names(): cheapest first, so these imports are not sorted.
# isort: off
from dtr.sim.planners.base import (STATUSES, PlanOptions, PlanResult, Planner, get_planner, planner_names,
                                   register_planner, run_planner)
from dtr.sim.planners import chen, rotor, lookahead, checkmate, fastsa, hierarchical  # noqa: F401
# isort: on

__all__ = ["PlanOptions", "PlanResult", "Planner", "register_planner", "get_planner", "planner_names", "run_planner",
           "STATUSES"]
