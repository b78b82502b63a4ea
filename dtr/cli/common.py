"""What the ``dtr-sim`` command modules share: the subcommand type, argument types and options.

A subcommand is a function ``run(args) -> int`` turned into a :class:`Command`
by the :func:`command` decorator, together with a function that adds its
arguments. Each command module lists its commands in ``COMMANDS``;
:data:`dtr.cli.COMMANDS` gathers them (see Note [Explicit command list] there).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from dtr.heuristics import COST_MODES, Heuristic, get_heuristic, heuristic_names
from dtr.semantics import check_thrash_limit

__all__ = ["Command", "command", "BUDGET_HELP", "add_budget_option", "add_heuristic_options", "heuristic_from_args",
           "thrash_limit_type", "int_type", "positive_seconds", "seed_type", "sample_type", "emit_json"]

# Note [Light imports]
# ~~~~~~~~~~~~~~~~~~~~
# Building the dtr-sim parser must import none of torch, matplotlib, scipy and
# numpy, and `dtr-sim replay` neither torch nor matplotlib. Building the
# parser imports every command module, so at their top these
# modules import only the standard library and light parts of dtr (errors,
# heuristics, units, dtr.sim.chain), and each command body imports what it
# runs (dtr.sim.sweep, dtr.sim.plot, dtr.sim.planners, dtr.zoo.record, ...).
# tests/cli/test_cli.py, tests/planners/test_planners.py and tests/sim/test_sweep.py check this.


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, argument setup and body."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None]
            ) -> Callable[[Callable[[argparse.Namespace], int]], Command]:
    """Decorator: make ``run(args) -> int`` the body of subcommand ``name``.

    Args:
        name: the subcommand's name (``dtr-sim NAME``).
        help: its one-line help (also its description).
        configure: adds its arguments to its parser.

    Returns:
        A decorator returning the :class:`Command`, which the module then lists
        in its ``COMMANDS``.
    """

    def wrap(run: Callable[[argparse.Namespace], int]) -> Command:
        return Command(name, help, configure, run)

    return wrap


def _number(text: str) -> float:
    """``text`` as a float, or argparse's error saying it is not a number."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def thrash_limit_type(text: str) -> float:
    """argparse type of a thrash limit: a number >= 1 (the rule: :func:`dtr.semantics.check_thrash_limit`)."""
    try:
        return check_thrash_limit(_number(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_type(low: int, high: int, what: str = "a whole number") -> Callable[[str], int]:
    """argparse type of a whole number from ``low`` to ``high`` (inclusive).

    Args:
        low: the smallest value accepted.
        high: the largest value accepted.
        what: the value's name in the error message.

    Returns:
        The parser; argparse names it ``int`` in its messages.
    """

    def parse(text: str) -> int:
        try:
            x = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= x <= high:
            raise argparse.ArgumentTypeError(f"{what} must be from {low} to {high} (got {text})")
        return x

    parse.__name__ = "int"
    return parse


def positive_seconds(text: str) -> float:
    """argparse type of a time limit: a finite number of seconds > 0."""
    x = _number(text)
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"the time limit must be a finite number of seconds > 0 (got {text})")
    return x


#: --seed: the core's seed is an unsigned 64-bit integer.
seed_type = int_type(0, 2**64 - 1, "the seed")
#: --sample: a count of pool members (0: all).
sample_type = int_type(0, 2**31 - 1, "the sample size")

#: --budget's help where it stands alone.
BUDGET_HELP = "bytes, a size (6GiB, 500MB) or N%% of the log's peak; default: no limit"


def add_budget_option(p: Any, help: str = BUDGET_HELP) -> None:
    """--budget B: a budget of a log, resolved later against its peak (:func:`dtr.sim.replay.resolve_budget`).

    ``dtr-sim chain --budget`` is another option (a number of unit tensors)
    and does not use this.

    Args:
        p: a parser or an argument group (compare puts it in a mutually exclusive one).
        help: the option's help, when it differs from :data:`BUDGET_HELP`.
    """
    p.add_argument("--budget", default=None, metavar="B", help=help)


def add_heuristic_options(sp: argparse.ArgumentParser, default_limit: float = 3.0) -> None:
    """--heuristic, --thrash-limit, ablation switches, --seed, --sample, --json.

    Args:
        sp: the subcommand's parser.
        default_limit: the default of --thrash-limit.
    """
    sp.add_argument("--heuristic", default="eqclass", choices=heuristic_names(),
                    help="eviction heuristic (default: eqclass)")
    sp.add_argument("--thrash-limit", type=thrash_limit_type, default=default_limit, metavar="X",
                    help=f"stop once total compute passes X times the base compute (default: {default_limit:g})")
    sp.add_argument("--cost", choices=COST_MODES, default=None, help="ablation: the cost term")
    sp.add_argument("--no-size", action="store_true", help="ablation: ignore storage sizes")
    sp.add_argument("--no-staleness", action="store_true", help="ablation: ignore staleness")
    sp.add_argument("--seed", type=seed_type, default=0, help="seed for random choices (default: 0)")
    sp.add_argument("--sample", type=sample_type, default=0, metavar="K",
                    help="score only K random pool members per eviction (default: all)")
    sp.add_argument("--json", action="store_true", help="print JSON")


def heuristic_from_args(args: argparse.Namespace) -> Heuristic:
    """The heuristic named by --heuristic with the ablation switches applied."""
    h = get_heuristic(args.heuristic)
    return h.ablate(cost=args.cost, size=False if args.no_size else None,
                    staleness=False if args.no_staleness else None)


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout."""
    print(json.dumps(obj))
