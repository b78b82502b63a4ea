"""``dtr-sim``: the simulator's command line (a thin layer over :mod:`dtr.sim`).

Exit status: 0 when the command ran (whatever the replay's status), 2 for bad
input (a malformed log, an unknown heuristic, a bad budget), with a one-line
message on stderr and no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import List, Optional

from dtr.errors import DtrError
from dtr.sim.chain import MAX_CHAIN
from dtr.sim.commands import COMMANDS, add_heuristic_options, command, heuristic_from_args
from dtr.units import format_bytes

__all__ = ["main", "COMMAND_MODULES"]

# Modules whose import registers more subcommands (see dtr.sim.commands).
COMMAND_MODULES: tuple = ("dtr.sim.cmd_schedules", "dtr.sim.cmd_experiments", "dtr.sim.cmd_record")


def _summary(d: dict) -> str:
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
    if d["status"] == "oom" and d.get("needed_bytes"):
        lines.append(f"needed         at least {format_bytes(d['needed_bytes'])} ({d['needed_bytes']} B) "
                     f"resident at once (log line {d.get('failed_line') or 'end'})")
    if d["status"] == "thrash":
        lines.append(f"stopped        total compute passed {d['thrash_limit']}x base "
                     f"(log line {d.get('failed_line') or 'end'})")
    return "\n".join(lines)


def _emit(args: argparse.Namespace, d: dict) -> None:
    if args.json:
        print(json.dumps(d))
    else:
        print(_summary(d))


def _replay_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("log", help="path to the log")
    r.add_argument("--budget", default=None, metavar="B",
                   help="bytes, a size (6GiB, 500MB) or N%% of the log's peak; default: no limit")
    r.add_argument("--banish", action="store_true", help="banish on last release instead of eager eviction")
    add_heuristic_options(r)


@command("replay", "replay a log (v1 or simrd, gzip or not)", _replay_args)
def _replay(args: argparse.Namespace) -> int:
    from dtr.sim.replay import replay
    res = replay(args.log, heuristic_from_args(args), args.budget, thrash_limit=args.thrash_limit,
                 banish=args.banish, seed=args.seed, sample=args.sample)
    _emit(args, res.to_dict())
    return 0


def _chain_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--n", type=int, required=True,
                   help=f"number of layers (1 to {MAX_CHAIN})")
    c.add_argument("--budget", required=True, metavar="{sqrt,log,INT}",
                   help="sqrt = ceil(2 sqrt n), log = ceil(log2 n), or a number of unit tensors")
    c.add_argument("--eager", action="store_true",
                   help="eager eviction instead of banishing (the paper's chain runs banish)")
    add_heuristic_options(c)


@command("chain", "the linear-chain toy model (simrd Algorithm 3)", _chain_args)
def _chain(args: argparse.Namespace) -> int:
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
    _emit(args, d)
    return 0


def _parser() -> argparse.ArgumentParser:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    p = argparse.ArgumentParser(prog="dtr-sim", description="Replay operator logs under a memory budget (DTR).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS.values():
        cmd.configure(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``dtr-sim``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except BrokenPipeError:
        return 0
    except (DtrError, ValueError) as e:
        _error(str(e))
        return 2
    except OSError as e:  # a file the user named cannot be read or written
        where = f"{e.filename}: " if e.filename is not None else ""
        _error(f"{where}{e.strerror or e}")
        return 2


def _error(message: str) -> None:
    """Print one line on stderr: ``dtr-sim: error: MESSAGE`` (control characters escaped)."""
    one_line = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message)
    print(f"dtr-sim: error: {one_line}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
