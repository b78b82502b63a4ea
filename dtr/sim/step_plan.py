"""A recorded step planned with its future known, as a plan the core follows op by op in later steps.

The planners (:mod:`dtr.sim.planners`) turn a log into a static schedule over
its exact graph; :func:`make_step_plan` checks that schedule with the one
evaluator (:func:`dtr.sim.schedule.evaluate`) at the budget and rewrites it
in the core's terms: before each op of the step (by ordinal), the storages to
evict and the ops to recompute (Note [Following a plan] in
csrc/core_follow.cpp). ``dtr.budget(..., plan=True)`` follows such plans in a
training loop (:mod:`dtr.runtime.step_plans`), ``dtr-sim replay --plan`` over
a log.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from dtr.core import FollowPlan, ReplayStatus, replay_program
from dtr.errors import DtrError
from dtr.heuristics import get_heuristic
from dtr.sim.graph import Graph, PlanGraph, PlanGraphError, graph_from_log, plan_graph
from dtr.sim.logs import Log, not_a_file, parse_text, read_bytes, read_log
from dtr.sim.planners import PlanOptions, PlanResult, planner_names, run_planner
from dtr.sim.schedule import COMPUTE, evaluate, named_os_error, out_of_order, plan_schedule

__all__ = ["StepPlan", "StepPlanError", "make_step_plan", "later_step_log", "step_signature", "log_fingerprints",
           "load_step_plan", "save_step_plan", "DEFAULT_PLANNER", "AUTO", "AUTO_PLANNERS", "EVICT", "RECOMPUTE"]

#: ``auto``: each of AUTO_PLANNERS in turn with an equal share of the time the earlier ones left; the plan
#: whose following recomputes least. FastSA comes last: it anneals until its time is up (and starts from
#: the best of lookahead's plan and DTR's runs).
AUTO = "auto"
AUTO_PLANNERS = ("lookahead", "hierarchical", "checkmate-lp", "fastsa")
#: The replays that judge a plan (online DTR's, and the core following the plan) stop past this thrash limit
#: (the runtime's default): a replay that thrashes counts as recomputing without end, and always ends.
THRASH_LIMIT = 10.0
#: FastSA's first-stage iterations per planning-graph node (its annealing rounds get a tenth): the paper's
#: fixed 20M would take the whole time limit on a small step; a 1000-node GPT step gets the paper's count.
FASTSA_STEPS_PER_NODE = 20_000
#: The planner a plan uses unless told.
DEFAULT_PLANNER = AUTO
EVICT, RECOMPUTE = 0, 1
#: A step may start with up to this fraction of the budget more than the recorded one did and still follow its
#: plan (the online heuristic makes up for it); one that starts with more runs online (Note [A step that starts
#: with more] in csrc/core_follow.cpp).
START_MARGIN = 1 / 16


class StepPlanError(DtrError):
    """A plan file that cannot be read, or one that does not fit the log it is given with."""


@dataclass(frozen=True)
class StepPlan:
    """A plan for one step, in the core's terms.

    Attributes:
        fingerprints: per op ordinal of the recorded step, its fingerprint.
        starts: per ordinal k, where its steps begin in ``steps`` (one more
            entry than ``fingerprints``: the last is ``len(steps)``).
        steps: ``(EVICT, op, output)`` or ``(RECOMPUTE, op, 0)``, ops by ordinal.
        status: ``ok`` (a plan to follow), or why there is none: the
            planner's status, ``invalid`` (the evaluator refused its schedule),
            ``n/a`` (no planning graph) or ``no gain`` (online DTR recomputes
            no more at this budget).
        planner: the planner's name.
        budget_bytes: the budget it was made for.
        predicted_remat: the recomputation the plan costs, by the evaluator
            (the log's cost unit).
        online_remat: what online DTR's replay of the same log recomputes at
            the same budget (``inf`` when it stops: out of budget, thrashing).
        base_compute: the step's own compute.
        cost_unit: the unit of the three.
        message: the planner's or evaluator's word.
        solve_seconds: the planner's wall time.
        predicted_remats: the recomputations following the plan makes (the
            evaluator's replay; ``predicted_remat`` is their ops' cost).
        online_remats: those online DTR's replay makes.
        remat_overhead: the cost charged per recomputation when the plan was
            chosen, on top of its op's (Note [The cost of a recomputation]).
        start_bytes: the bytes resident at the recorded step's first op, as a
            later step counts them (Note [Planning the steps that follow]); -1:
            unknown (then any step may follow it).
    """

    fingerprints: Tuple[int, ...]
    starts: Tuple[int, ...]
    steps: Tuple[Tuple[int, int, int], ...]
    status: str
    planner: str
    budget_bytes: int
    predicted_remat: float
    online_remat: float
    base_compute: float
    cost_unit: str
    message: str = ""
    solve_seconds: float = 0.0
    predicted_remats: int = 0
    online_remats: int = 0
    remat_overhead: float = 0.0
    start_bytes: int = -1
    _follow: list = field(default_factory=list, repr=False, compare=False)  # the cached FollowPlan

    @property
    def ok(self) -> bool:
        """Whether there is a plan to follow."""
        return self.status == "ok"

    @property
    def signature(self) -> str:
        """The recorded step's signature (:func:`step_signature`)."""
        return step_signature(self.fingerprints)

    @property
    def start_limit(self) -> int:
        """The most bytes a step may hold at its first op and follow the plan (-1: any): the recorded start plus
        START_MARGIN of the budget (Note [A step that starts with more] in csrc/core_follow.cpp)."""
        return -1 if self.start_bytes < 0 else self.start_bytes + int(self.budget_bytes * START_MARGIN)

    def follow_plan(self) -> FollowPlan:
        """The plan as the core takes it (made once)."""
        if not self._follow:
            self._follow.append(FollowPlan(list(self.fingerprints), list(self.starts), list(self.steps),
                                           start_limit=self.start_limit))
        return self._follow[0]

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("status", "planner", "budget_bytes", "predicted_remat", "online_remat",
                                          "base_compute", "cost_unit", "message", "solve_seconds",
                                          "predicted_remats", "online_remats", "remat_overhead", "start_bytes")}
        if not math.isfinite(d["online_remat"]):
            d["online_remat"] = None
        return {"format": "dtr-step-plan", "version": 1, **d, "fingerprints": [str(f) for f in self.fingerprints],
                "starts": list(self.starts), "steps": [list(s) for s in self.steps]}

    @staticmethod
    def from_json(doc: dict) -> "StepPlan":
        """Raises: StepPlanError: not a plan (``to_json``'s)."""
        try:
            if doc.get("format") != "dtr-step-plan":
                raise ValueError("not a dtr-step-plan document")
            online = doc["online_remat"]
            return StepPlan(
                fingerprints=tuple(int(f) for f in doc["fingerprints"]), starts=tuple(int(x) for x in doc["starts"]),
                steps=tuple((int(a), int(b), int(c)) for a, b, c in doc["steps"]), status=str(doc["status"]),
                planner=str(doc["planner"]), budget_bytes=int(doc["budget_bytes"]),
                predicted_remat=float(doc["predicted_remat"]),
                online_remat=math.inf if online is None else float(online), base_compute=float(doc["base_compute"]),
                cost_unit=str(doc["cost_unit"]), message=str(doc.get("message", "")),
                solve_seconds=float(doc.get("solve_seconds", 0.0)),
                predicted_remats=int(doc.get("predicted_remats", 0)), online_remats=int(doc.get("online_remats", 0)),
                remat_overhead=float(doc.get("remat_overhead", 0.0)), start_bytes=int(doc.get("start_bytes", -1)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StepPlanError(f"not a step plan: {e}") from None


def step_signature(fingerprints: Sequence[int]) -> str:
    """A step's signature: a digest of its ops' fingerprints, equal for steps of the same ops and shapes."""
    h = hashlib.blake2b(digest_size=12)
    h.update(struct.pack(f"<{len(fingerprints)}Q", *fingerprints))
    return h.hexdigest()


def log_fingerprints(log: Log) -> List[int]:
    """Each op's fingerprint in a replay of ``log`` without a budget (as the runtime that wrote it saw them)."""
    return _recorded(log)[0]


def _recorded(log: Log) -> Tuple[List[int], int]:
    """``log``'s fingerprints and the bytes resident at its first op, from one replay without a budget."""
    r = replay_program(log.program, "eqclass", None, semantics=log.semantics, fingerprints=True)
    return list(r["fingerprints"]), int(r["start_memory"])


class _Baseline(NamedTuple):
    """What every candidate plan of one step is judged against."""

    fps: Tuple[int, ...]   # the step's fingerprints
    budget: int
    online: float          # online DTR's recomputation (its ops' cost; inf: it does not finish)
    online_remats: int     # and its count
    base: float            # the step's own compute
    unit: str
    overhead: float        # the charge per recomputation (Note [The cost of a recomputation])
    start: int             # the bytes resident at the step's first op

    def charged(self, remat: float, remats: int) -> float:
        """A recomputation's total: its ops' cost and the charge per recomputation."""
        return remat + remats * self.overhead

    def plan(self, status: str, message: str, planner: str, seconds: float = 0.0, predicted: float = math.inf,
             remats: int = 0, starts: Optional[Tuple[int, ...]] = None,
             steps: Tuple[Tuple[int, int, int], ...] = ()) -> StepPlan:
        """A StepPlan for this step (no steps: following nothing, with ``status`` saying why)."""
        return StepPlan(self.fps, starts or tuple([0] * (len(self.fps) + 1)), steps, status, planner, self.budget,
                        predicted, self.online, self.base, self.unit, message, seconds, predicted_remats=remats,
                        online_remats=self.online_remats, remat_overhead=self.overhead, start_bytes=self.start)


def _charged(pg: PlanGraph, overhead: float) -> PlanGraph:
    """The planning graph with ``overhead`` added to each node's cost per operator it recomputes.

    Views run with their base and are never recomputed on their own (Note [Versions] in
    dtr/runtime/recompute.py), so only operators that allocate or write count.
    """
    if overhead <= 0:
        return pg
    g = pg.graph
    n_ops = [sum(1 for k in ops if g.op_fresh[k] or g.op_kind[k] == "mutate") for ops in pg.ops]
    return replace(pg, cost=tuple(c + overhead * n for c, n in zip(pg.cost, n_ops)))


# Note [What a plan predicts]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A planner's schedule is over the planning graph's order, which is not
# always the step's: a view joins its base's node and runs with it, long
# before the program asks for it. The core follows a plan only at the step's
# own ops, and brings back on demand what the schedule had made early. So
# the schedule's own recomputation (the evaluator's figure) is not what
# following it costs. What it costs is known exactly before any step follows
# it: the core that replays the recorded log with the plan is the runtime's
# (record -> replay equality). make_step_plan therefore replays the log
# following the plan, predicts that run's recomputation, and keeps the plan
# only if it finishes and recomputes less than online DTR's replay at the
# same budget.


# Note [The cost of a recomputation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A log's measured cost of an op is the op's own time. Recomputing it in the
# runtime costs more: the recomputer rebuilds its inputs' views, hands over or
# copies what it writes, and adopts or copies its outputs, in Python (Note
# [Adopting recomputed bytes] in dtr/runtime/recompute.py). On the 2-core CPU
# that was 30-130 us per recomputation (small GPT, MLP, CNN and TreeLSTM
# steps), beside ops of 0.1-1 ms: small steps' recomputation ran 1.2-1.8x
# their ops' cost. A plan that trades one expensive recomputation for several
# cheap ones can lose what it predicts, and a prediction that leaves this out
# is off by it. So make_step_plan takes ``remat_overhead``, a cost per
# recomputation the runtime measured (StepPlans: what a step's recomputation
# took beyond its ops' cost, per recomputation, the median of recent steps):
# the planners see each node cost that much more per operator it recomputes
# (_charged), the core's replays that judge a plan and online DTR count it per
# recomputation, and the plan records the count it predicts
# (``predicted_remats``) so that the runtime's prediction adds it at the
# overhead it measures when the step runs. With costs that are not times the
# charge is 0 and nothing changes.


# Note [Planning the steps that follow]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A plan is followed by the steps after the one recorded, and the first block
# of a program counts a constant only from the op that first touches it,
# while every later block counts what the program held at the previous
# block's end from its first op (Note [Constants from earlier blocks] in
# dtr/runtime/driver.py). A plan made from a first step's log as it stands
# therefore spends, early in the step, memory that later steps do not have:
# on the CPU GPT at C + 50% P (C: 39 MiB of weights and gradients) every
# later step needed 3-8 evictions of the heuristic's own, and recomputed 70
# ops where the plan predicted 59 (1.5x the predicted time). With
# ``later_steps`` the plan is made from the log as a later step would record
# it: every constant the log never releases (what the program still holds at
# the end) is declared at the start. Constants have no op ordinal, so the plan
# points are the same; the prediction and online DTR's figure are for the
# rewritten log. A log recorded by a later block is unchanged by this.


def later_step_log(log: Log) -> Log:
    """The log as a later step would record it (Note [Planning the steps that follow]).

    Args:
        log: a v1 log read from a file (another, or one already so, is returned as it is).

    Returns:
        The log with every constant it never releases declared before its first other line.
    """
    if log.format != "v1" or not os.path.isfile(log.path):
        return log
    lines = read_bytes(log.path).decode("utf-8", "surrogatepass").splitlines()
    docs = [json.loads(line) if line.strip() else None for line in lines]
    declared: Dict[str, int] = {}
    dropped = set()
    for d in docs:
        if isinstance(d, dict) and d.get("op") == "constant":
            declared[d["id"]] = declared.get(d["id"], 0) + 1
        elif isinstance(d, dict) and d.get("op") == "release":
            dropped.add(d.get("id"))
    kept = {c for c, n in declared.items() if n == 1 and c not in dropped}
    first = next((i for i, d in enumerate(docs) if isinstance(d, dict) and d.get("op") != "meta"), len(docs))
    hoisted = [i for i, d in enumerate(docs) if isinstance(d, dict) and d.get("op") == "constant"
               and d["id"] in kept]
    if hoisted == list(range(first, first + len(hoisted))):
        return log  # (already at the start)
    moved = set(hoisted)
    rest = [i for i in range(first, len(lines)) if i not in moved]
    order = list(range(first)) + hoisted + rest
    return parse_text("\n".join(lines[i] for i in order) + "\n", log.path)


def make_step_plan(log: Union[Log, str, os.PathLike], budget: int, planner: str = DEFAULT_PLANNER, *,
                   time_limit: float = 30.0, graph: Optional[Graph] = None, later_steps: bool = False,
                   remat_overhead: float = 0.0) -> StepPlan:
    """Plan a recorded step at ``budget`` and write the schedule as a plan the core follows.

    The planner's schedule must pass the evaluator at the budget, and
    recompute less than online DTR's replay of the same log does there (with
    eqclass: the runtime's heuristic); otherwise the result has no steps and
    says why in ``status`` (following nothing is online DTR). Between two
    first computations of the schedule, its frees and recomputations become
    the steps of the later one (the core runs them right before that op);
    frees of constants are left out (the runtime never evicts one), and so is
    what the schedule does after the step's last op (the block's end brings
    back what the program holds).

    Args:
        log: the recorded step (a parsed log or a path).
        budget: bytes, as the runtime counts them (the log's constants included).
        planner: a registered planner, or ``auto`` (:data:`AUTO_PLANNERS`, each with a share of the time).
        time_limit: the planners' time limit, seconds, in all.
        graph: the log's exact graph, if already extracted (not used with ``later_steps``).
        later_steps: plan for the steps after the recorded one, which count the constants the program
            keeps from their start (Note [Planning the steps that follow]); the runtime's plans do.
        remat_overhead: a cost (the log's unit) charged per recomputation on top of its op's, when planning
            and when judging a plan against online DTR: the runtime's own work around each one (Note [The
            cost of a recomputation]). 0 for costs that are not measured times.

    Raises:
        ValueError: an unknown planner (the message lists the valid ones), or a time limit that is not a
            finite number of seconds > 0.
        LogFormatError: ``log`` is a path to a bad log.
    """
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not (
            math.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"the time limit must be a finite number of seconds > 0, not {time_limit!r}")
    names = AUTO_PLANNERS if planner == AUTO else (planner,)
    for name in names:
        if name not in planner_names():
            raise ValueError(f"unknown planner {planner!r}; the planners are: {AUTO}, {', '.join(planner_names())}")
    if not isinstance(log, Log):
        log = read_log(log)
    if later_steps:
        log, graph = later_step_log(log), None
    fps, start = _recorded(log)
    g = graph or graph_from_log(log)
    online_raw = replay_program(log.program, get_heuristic("eqclass"), int(budget), semantics=log.semantics,
                                thrash_limit=THRASH_LIMIT)
    ok = online_raw["status"] == ReplayStatus.OK
    if not (remat_overhead >= 0 and math.isfinite(remat_overhead)):
        raise ValueError(f"remat_overhead must be a finite cost >= 0, not {remat_overhead!r}")
    base = _Baseline(tuple(fps), int(budget), online_raw["remat_compute"] if ok else math.inf,
                     online_raw["remats"] if ok else 0, g.base_compute, g.cost_unit, float(remat_overhead), start)
    try:
        pg = plan_graph(g)
    except PlanGraphError as e:
        return base.plan("n/a", str(e), planner)
    best: Optional[StepPlan] = None
    best_seq: Optional[Tuple[int, ...]] = None
    why: List[str] = []
    deadline = time.perf_counter() + time_limit
    for i, name in enumerate(names):
        share = max(0.0, deadline - time.perf_counter()) / (len(names) - i)
        p, seq = _candidate(log, g, pg, base, name, share, best_seq)
        if p.ok and (best is None or _total(p) < _total(best)):
            best, best_seq = p, seq
        msg = p.message if len(p.message) <= 300 else p.message[:297] + "..."
        why.append(f"{name}: {p.status} ({msg})" if len(names) > 1 else p.message)
    if best is None:
        statuses = {w.split(":")[1].split("(")[0].strip() for w in why} if len(names) > 1 else set()
        status = "no gain" if len(names) > 1 else p.status
        if statuses and statuses <= {"no gain"}:
            status = "no gain"
        return base.plan(status, "; ".join(why), planner, predicted=p.predicted_remat, remats=p.predicted_remats)
    return replace(best, planner=best.planner if planner != AUTO else f"{AUTO}:{best.planner}")


def _total(p: StepPlan) -> float:
    """A plan's predicted recomputation with its charge per recomputation."""
    return p.predicted_remat + p.predicted_remats * p.remat_overhead


def _candidate(log: Log, g: Graph, pg: PlanGraph, base: _Baseline, planner: str, time_limit: float,
               start: Optional[Tuple[int, ...]] = None) -> Tuple[StepPlan, Optional[Tuple[int, ...]]]:
    """One planner's plan, with what following it recomputes (Note [What a plan predicts]), and its sequence.

    ``start``: the best sequence so far, which FastSA refines along with its own warm starts.
    """
    res = run_planner(planner, _charged(pg, base.overhead), base.budget,
                      PlanOptions(time_limit=time_limit, in_order=True, start=start,
                                  sa_steps=FASTSA_STEPS_PER_NODE * pg.n))
    plan = _followed(log, g, pg, base, planner, res)
    return plan, (res.sequence if plan.ok else None)


def _followed(log: Log, g: Graph, pg: PlanGraph, base: _Baseline, planner: str, res: PlanResult) -> StepPlan:
    """The plan of a planner's result, if following it finishes and recomputes less than online DTR."""
    seconds = res.solve_seconds
    if res.sequence is None:
        return base.plan(res.status, res.message, planner, seconds)
    bad = out_of_order(res.sequence)
    if bad is not None:  # Note [Schedules a step can follow]
        return base.plan("invalid", f"the schedule computes node {bad[1]} for the first time after node {bad[0]}: "
                                    f"a step runs its ops in the program's order", planner, seconds)
    schedule = plan_schedule(pg, res.sequence)
    ev = evaluate(g, schedule.steps, base.budget)
    if not ev.valid:
        return base.plan("invalid", f"the evaluator refused the schedule: {ev.error}", planner, seconds)
    plan, followed = None, None
    for hold in (False, True):
        starts, steps = _plan_points(g, schedule.steps, hold_for_views=hold)
        p = base.plan("ok", res.message, planner, seconds, starts=starts, steps=steps)
        run = replay_program(log.program, get_heuristic("eqclass"), base.budget, semantics=log.semantics,
                             thrash_limit=THRASH_LIMIT,
                             plan=p.follow_plan())
        if followed is None or _better(run, followed, base):
            plan, followed = p, run
    assert plan is not None and followed is not None
    schedule_remat = ev.total_compute - ev.base_compute
    unit = g.cost_unit
    if followed["status"] != ReplayStatus.OK:
        return base.plan("no gain", f"following it ends {followed['status']}; the schedule recomputes "
                                    f"{schedule_remat:g} {unit}", planner, seconds)
    predicted, remats = followed["remat_compute"], followed["remats"]
    charge = (f"; with {base.overhead:g} {unit} charged per recomputation, {remats} of them against online "
              f"DTR's {base.online_remats}") if base.overhead > 0 else ""
    if base.charged(predicted, remats) >= base.charged(base.online, base.online_remats):
        return base.plan("no gain", f"following it recomputes {predicted:g} {unit} (the schedule "
                                    f"{schedule_remat:g}), online DTR {base.online:g}{charge}", planner, seconds,
                         predicted=predicted, remats=remats)
    return replace(plan, predicted_remat=predicted, predicted_remats=remats,
                   message=f"the schedule recomputes {schedule_remat:g} {unit}, following it {predicted:g}{charge}")


def _better(a: dict, b: dict, base: _Baseline) -> bool:
    """Whether replay ``a`` is better than ``b``: it finishes where ``b`` does not, or recomputes less."""
    a_ok, b_ok = a["status"] == ReplayStatus.OK, b["status"] == ReplayStatus.OK
    return a_ok and (not b_ok or base.charged(a["remat_compute"], a["remats"])
                     < base.charged(b["remat_compute"], b["remats"]))


# Note [Plan points]
# ~~~~~~~~~~~~~~~~~~
# The core runs a plan's steps right before an op of the step (Note
# [Following a plan] in csrc/core_follow.cpp), so each free and recomputation
# of the schedule is attached to an op: the next op the schedule computes for
# the first time. Three things differ from that simple rule:
# - a free right before an op that overwrites the storage is the in-place
#   write's own hand-over (Note [In-place writes in a schedule] in
#   dtr.sim.schedule), which the core makes itself: it is dropped;
# - a view that the schedule runs before its turn (a planner runs a view with
#   its base) is not placed there: the program cannot ask for it early. Its
#   point is where the schedule runs it again, if it does before its turn
#   comes, or its turn. The program will ask for it at its turn, and making it
#   needs what it reads: a schedule that freed that in between makes the core
#   recompute it there. Holding those frees until the view's turn instead
#   keeps more resident. Which costs less depends on the step, so both are
#   written and replayed, and the cheaper kept (Note [What a plan predicts]);
# - any other op run before its turn takes its steps to the first op not
#   placed yet.
# Frees of constants are dropped (the runtime never evicts one), and so is
# what the schedule does after the step's last op.


def _plan_points(g: Graph, schedule: Sequence[Tuple[str, int]], hold_for_views: bool = False
                 ) -> Tuple[Tuple[int, ...], Tuple[Tuple[int, int, int], ...]]:
    """The schedule's frees and recomputations, each attached to an op of the step (Note [Plan points]).

    Args:
        g: the graph.
        schedule: its steps.
        hold_for_views: frees of what an early view reads wait until the view is placed.
    """
    at: List[List[Tuple[int, int, int]]] = [[] for _ in range(g.num_ops)]
    placed = bytearray(g.num_ops)
    early: set = set()  # views the schedule ran before their turn, not placed yet
    reads: dict = {}  # an early view -> the storages it reads
    held: List[Tuple[set, Tuple[int, int, int]]] = []  # frees waiting for early views to be placed
    nxt = 0  # the first op (by ordinal) not placed yet
    pending: List[Tuple[int, int, int]] = []
    freed: dict = {}  # storage freed since the last compute step -> its step's position in pending
    for kind, x in schedule:
        if kind != COMPUTE:
            if not g.storage_constant[x]:
                op = g.storage_op[x]
                step = (EVICT, op, g.op_outputs[op].index(g.storage_tensors[x][0]))
                waits = {v for v in early if x in reads[v]} if hold_for_views else set()
                if waits:
                    held.append((waits, step))
                    continue
                freed[x] = len(pending)
                pending.append(step)
            continue
        handed = {freed[s] for s in g.op_overwrites[x] if s in freed}
        if handed:
            pending = [st for i, st in enumerate(pending) if i not in handed]
        freed.clear()
        if placed[x]:
            pending.append((RECOMPUTE, x, 0))
            continue
        if x > nxt and not g.op_fresh[x] and any(not placed[y] and y not in early for y in range(nxt, x)):
            early.add(x)  # a view run before its turn: placed where the schedule runs it again, or in order
            reads[x] = {g.tensor_storage[t] for t in g.op_inputs[x]}
            continue
        target = x if all(placed[y] or y in early for y in range(nxt, x)) else nxt
        at[target].extend(pending)
        pending = []
        for y in range(nxt, x):
            if y in early:
                placed[y] = 1
        placed[x] = 1
        early = {v for v in early if not placed[v]}
        while nxt < g.num_ops and placed[nxt]:
            nxt += 1
        if held:  # frees no early view waits for any more run before the next op
            pending.extend(step for waits, step in held if not waits & early)
            held = [(waits, step) for waits, step in held if waits & early]
    return _by_ordinal(g, at)


def _by_ordinal(g: Graph, at: Sequence[List[Tuple[int, int, int]]]
                ) -> Tuple[Tuple[int, ...], Tuple[Tuple[int, int, int], ...]]:
    """The steps attached to the graph's ops as the core numbers them: by ordinal, which constants do not get.

    What was attached to a constant runs before the next op that has an ordinal (Note [Following a plan] in
    csrc/core_follow.cpp).
    """
    ordinal = [-1] * g.num_ops
    n = 0
    for k in range(g.num_ops):
        if g.op_kind[k] != "constant":
            ordinal[k] = n
            n += 1
    starts = [0]
    steps: List[Tuple[int, int, int]] = []
    waiting: List[Tuple[int, int, int]] = []
    for k, point in enumerate(at):
        waiting.extend((kind, ordinal[op], i) for kind, op, i in point if ordinal[op] >= 0)
        if ordinal[k] >= 0:
            steps.extend(waiting)
            waiting = []
            starts.append(len(steps))
    return tuple(starts), tuple(steps)


def save_step_plan(plan: StepPlan, path: Union[str, os.PathLike]) -> None:
    """Write a plan as JSON (``dtr-sim replay --plan FILE`` reads it).

    Raises:
        OSError: the file cannot be written (its ``filename`` is ``path``).
    """
    try:
        with open(path, "w") as f:
            json.dump(plan.to_json(), f)
            f.write("\n")
    except OSError as e:
        raise named_os_error(e, path) from None


def load_step_plan(path: Union[str, os.PathLike]) -> StepPlan:
    """Read a plan written by :func:`save_step_plan`.

    Raises:
        StepPlanError: not a readable plan.
    """
    try:
        with open(path) as f:
            kind = not_a_file(f)
            if kind is not None:
                raise StepPlanError(f"{os.fspath(path)}: not a plan file: this is {kind}; give a file written by "
                                    "--save-plan")
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise StepPlanError(f"{os.fspath(path)}: cannot read the plan: {e}") from None
    if not isinstance(doc, dict):
        raise StepPlanError(f"{os.fspath(path)}: not a step plan (expected a JSON object)")
    try:
        return StepPlan.from_json(doc)
    except StepPlanError as e:
        raise StepPlanError(f"{os.fspath(path)}: {e}") from None

