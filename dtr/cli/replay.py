"""``dtr-sim replay`` and ``dtr-sim chain``: one replay, of a log or of the linear-chain toy model.

Both print the same summary (or, with --json, :meth:`dtr.sim.ReplayResult.to_dict`).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dtr.cli.common import (
    add_budget_option,
    add_heuristic_options,
    command,
    emit_json,
    heuristic_from_args,
    positive_seconds,
)
from dtr.errors import DtrError
from dtr.sim.chain import MAX_CHAIN
from dtr.units import format_bytes

if TYPE_CHECKING:
    from dtr.sim.logs import Log

__all__ = ["COMMANDS"]


def _stopped(d: dict, base_ops: int) -> str:
    """Which of the thrash limit's two allowances a replay that stopped (``thrash``) passed, in words.

    Args:
        d: the replay's dict.
        base_ops: the ops of the log (calls and mutations), the count allowance's base.

    Returns:
        What passed what (Note [The thrash limit] in :mod:`dtr.semantics`), one line.
    """
    from dtr.semantics import remat_allowance, remat_count_allowance
    x, unit = d["thrash_limit"], d.get("cost_unit", "")
    allowed, n_allowed = remat_allowance(x, d["base_compute"]), remat_count_allowance(x, base_ops)
    why = []
    if d["remat_compute"] > allowed:
        why.append(f"recomputed {d['remat_compute']:g} {unit}, more than ({x:g} - 1) x the log's "
                   f"{d['base_compute']:g} {unit}")
    if d["remats"] > n_allowed:
        why.append(f"{d['remats']} recomputations, more than ({x:g} - 1) x the log's {base_ops} ops")
    return f"thrash limit {x:g}: " + ("; ".join(why) or "recomputation passed its allowance")


def _summary(d: dict, base_ops: int = 0) -> str:
    """The human-readable summary of a replay's dict (one field a line); ``base_ops``: the log's ops."""
    from dtr.core import ReplayStatus
    budget = "none" if d["budget_bytes"] is None else format_bytes(d["budget_bytes"])
    if d["budget_bytes"] is not None and d["budget_bytes"] >= 1024:
        budget += f" ({d['budget_bytes']} B)"
    unit = d.get("cost_unit", "")
    lines = [
        f"log            {d.get('log', '-')}",
        f"heuristic      {d['heuristic']}",
        f"budget         {budget}",
        f"status         {d['status']}",
        f"peak memory    {format_bytes(d['peak_bytes'])} (baseline {format_bytes(d['baseline_peak_bytes'])})",
        f"compute        {d['total_compute']:g} {unit} of {d['base_compute']:g} base: overhead {d['overhead']:.4f}",
        f"evictions      {d['evictions']} (plus {d.get('eager_evictions', 0)} on last release)",
        f"remats         {d['remats']}",
        f"storage access {d['storage_accesses']}",
    ]
    if d.get("planner") is not None:
        diverged = d["plan_diverged_at"]
        lines.append(f"plan           {d['planner']}: {d['plan_ops']} ops followed"
                     + (f", diverged at op {diverged}" if diverged is not None else ", to the end")
                     + f"; {d['planned_evictions']} planned evictions"
                     + (f"; predicted remat {d['predicted_remat']:g} {unit}" if d["predicted_remat"] is not None
                        else ""))
    if d.get("plan_note"):
        lines.append(f"plan           none: {d['plan_note']}")
    if d["status"] == ReplayStatus.OOM and d.get("needed_bytes"):
        lines.append(f"needed         at least {format_bytes(d['needed_bytes'])} ({d['needed_bytes']} B) "
                     f"resident at once (log line {d.get('failed_line') or 'end'})")
    if d["status"] == ReplayStatus.THRASH:
        lines.append(f"stopped        {_stopped(d, base_ops)} (log line {d.get('failed_line') or 'end'})")
    return "\n".join(lines)


def _emit(args: argparse.Namespace, d: dict, log: Log) -> None:
    """Print ``d``, the replay of ``log``, as JSON (--json) or as the summary."""
    if args.json:
        emit_json(d)
    else:
        print(_summary(d, log.program.base_ops()))


def _replay_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("log", help="path to the log")
    add_budget_option(r)
    r.add_argument("--banish", action="store_true", help="banish on last release instead of eager eviction")
    r.add_argument("--plan", metavar="PLANNER|FILE", default=None,
                   help="follow a plan (docs/planned-steps.md): a planner's name plans the log itself at the budget "
                        "(auto: the best of lookahead and hierarchical), a file is a plan saved with --save-plan")
    r.add_argument("--plan-time-limit", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="the planners' time limit with --plan PLANNER (default 30)")
    r.add_argument("--save-plan", metavar="FILE", default=None,
                   help="write the plan --plan PLANNER made to FILE")
    add_heuristic_options(r)


@command("replay", "replay a log (v1 or simrd, gzip or not)", _replay_args)
def replay_command(args: argparse.Namespace) -> int:
    """Replay one log under --budget with the chosen heuristic."""
    from dtr.sim.logs import read_log
    from dtr.sim.replay import replay
    if args.save_plan is not None and args.plan is None:
        raise DtrError("--save-plan needs --plan PLANNER (such as --plan auto): it writes the plan that planner "
                       "makes; add one, or leave out --save-plan")
    plan, note = None, None
    if args.plan is not None:
        log, plan, note = _plan_for(args)
    else:
        log = read_log(args.log)
    res = replay(log, heuristic_from_args(args), args.budget, thrash_limit=args.thrash_limit,
                 banish=args.banish, seed=args.seed, sample=args.sample, plan=plan)
    d = res.to_dict()
    if note is not None:
        d["plan_note"] = note
    _emit(args, d, log)
    return 0


def _plan_for(args: argparse.Namespace):
    """The log, the plan ``--plan`` names (None: no plan made) and, when none, why."""
    import os

    from dtr.sim.logs import read_log
    from dtr.sim.planners import planner_names
    from dtr.sim.replay import baseline, resolve_budget
    from dtr.sim.step_plan import AUTO, load_step_plan, make_step_plan, save_step_plan
    log = read_log(args.log)
    if args.plan != AUTO and args.plan not in planner_names():
        if not os.path.exists(args.plan):
            raise DtrError(f"--plan {args.plan!r} is neither a planner ({AUTO}, {', '.join(planner_names())}) nor "
                           f"a plan file")
        if args.save_plan is not None:
            raise DtrError(f"--save-plan needs --plan PLANNER: --plan {args.plan!r} is a plan file, so no plan is "
                           f"made to save")
        return log, load_step_plan(args.plan), None
    budget = resolve_budget(args.budget, baseline(log)["peak_memory"])
    if budget is None:
        raise DtrError("--plan needs a --budget: without one nothing is evicted, so there is nothing to plan")
    plan = make_step_plan(log, budget, args.plan, time_limit=args.plan_time_limit)
    if args.save_plan:
        save_step_plan(plan, args.save_plan)
    if not plan.ok:
        return log, None, f"{plan.status}: {plan.message}"
    return log, plan, None


def _chain_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--n", type=int, required=True,
                   help=f"number of layers (1 to {MAX_CHAIN})")
    c.add_argument("--budget", required=True, metavar="{sqrt,log,INT}",
                   help="sqrt = ceil(2 sqrt n), log = ceil(log2 n), or a number of unit tensors")
    c.add_argument("--eager", action="store_true",
                   help="eager eviction instead of banishing (the paper's chain runs banish)")
    add_heuristic_options(c)


@command("chain", "the linear-chain toy model (simrd Algorithm 3)", _chain_args)
def chain_command(args: argparse.Namespace) -> int:
    """Replay the n-layer linear chain (banishing unless --eager) under a budget of unit tensors."""
    from dtr.sim.chain import chain_budget, chain_log
    from dtr.sim.logs import parse_text
    from dtr.sim.replay import replay
    if args.n < 1:
        raise DtrError(f"--n must be at least 1 (got {args.n})")
    if args.n > MAX_CHAIN:
        raise DtrError(f"--n must be at most {MAX_CHAIN} (got {args.n}): the chain's log is built in memory")
    try:
        budget = chain_budget(args.n, args.budget)
    except ValueError as e:
        raise DtrError(str(e)) from None
    log = parse_text(chain_log(args.n), path=f"<chain n={args.n}>")
    res = replay(log, heuristic_from_args(args), budget, thrash_limit=args.thrash_limit,
                 banish=not args.eager, seed=args.seed, sample=args.sample)
    d = res.to_dict()
    d.update(n=args.n, extra_compute=res.total_compute - res.base_compute)
    _emit(args, d, log)
    return 0


#: The subcommands of this module, in the order ``dtr-sim --help`` lists them.
COMMANDS = (replay_command, chain_command)
