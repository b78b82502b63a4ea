"""``dtr-sim``: the simulator's command line, a thin layer over :mod:`dtr.sim` (and :mod:`dtr.zoo`).

One module per command group: :mod:`dtr.cli.replay` (replay, chain),
:mod:`dtr.cli.schedules` (export, compare), :mod:`dtr.cli.sweep`,
:mod:`dtr.cli.plot` and :mod:`dtr.cli.record`; :mod:`dtr.cli.common` holds
what they share. ``python -m dtr.cli`` is the same as ``dtr-sim``.

Exit status: 0 when the command ran (whatever the replay's status), 2 for bad
input (a malformed log, an unknown heuristic, a bad budget), with a one-line
message on stderr and no traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from dtr.cli import plot, record, replay, schedules, sweep
from dtr.cli.common import Command
from dtr.errors import DtrError

__all__ = ["main", "build_parser", "COMMANDS"]

# Note [Explicit command list]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each command module makes its subcommands with the @command decorator and
# lists them in its COMMANDS; this tuple gathers them, in the order
# `dtr-sim --help` shows them. Nothing registers itself on import: a new
# command is one more entry here (and in its module's COMMANDS).
#: Every subcommand of ``dtr-sim``.
COMMANDS: Tuple[Command, ...] = (*replay.COMMANDS, *schedules.COMMANDS, *sweep.COMMANDS, *plot.COMMANDS,
                                 *record.COMMANDS)


def build_parser() -> argparse.ArgumentParser:
    """The ``dtr-sim`` parser, with one subparser per entry of :data:`COMMANDS`."""
    p = argparse.ArgumentParser(prog="dtr-sim", description="Replay operator logs under a memory budget (DTR).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        cmd.configure(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``dtr-sim``.

    Args:
        argv: the arguments after the program name; default: ``sys.argv[1:]``.

    Returns:
        The exit status: 0 when the command ran, 2 for bad input (after one
        line on stderr). argparse's own errors (an unknown option, a number out
        of range) exit 2 through ``SystemExit`` instead, as argparse does.
    """
    args = build_parser().parse_args(argv)
    run = {cmd.name: cmd.run for cmd in COMMANDS}[args.command]
    try:
        return run(args)
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
