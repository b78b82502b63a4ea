"""``dtr-sim record``: record one training step of a zoo model as a v1 log.

The recording itself is :func:`dtr.zoo.record.record_model`. Light to import:
torch and :mod:`dtr.zoo` are imported inside the command function only
(``dtr-sim replay`` must not load torch).
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Tuple

from dtr.cli.common import command, int_type
from dtr.units import format_bytes

__all__ = ["COMMANDS"]

# Note [Manifest name]
# ~~~~~~~~~~~~~~~~~~~~
# The default manifest's name, for --manifest's help: dtr.zoo.record.MANIFEST_NAME,
# copied because importing dtr.zoo imports torch (see Note [Light imports] in
# dtr.cli.common). tests/zoo/test_zoo.py checks that the two agree.
MANIFEST_NAME = "MANIFEST.json"


def _option(text: str) -> Tuple[str, Any]:
    """argparse type of ``--set KEY=VALUE``: VALUE as JSON (numbers, booleans), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (got {text!r})")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _record_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a zoo model (resnet32, densenet-bc, unet, gpt, lstm, treelstm, hf-gpt2)")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="the log to write (.gz compresses), e.g. logs/MODEL.jsonl.gz")
    p.add_argument("--batch", type=int_type(1, 2**31 - 1, "--batch"), default=8, metavar="N",
                   help="batch size (default: 8)")
    p.add_argument("--seed", type=int_type(0, 2**63 - 1, "the seed"), default=0, metavar="S",
                   help="seed of the weights, the batch and the step's dropout (default: 0)")
    p.add_argument("--cost-model", choices=("flops", "time"), default="flops",
                   help="op costs in the log: flops (deterministic, default) or measured time")
    p.add_argument("--warmup", type=int_type(0, 1_000_000, "--warmup"), default=1, metavar="K",
                   help="training steps run outside dtr before the recorded one (default: 1)")
    p.add_argument("--set", dest="options", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="a model option (e.g. depth=40, seq_len=64); repeatable")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--manifest", default=None, metavar="FILE",
                   help=f"the manifest to update (default: {MANIFEST_NAME} next to OUT)")


@command("record", "record one training step of a zoo model as a v1 log", _record_args)
def record_command(args: argparse.Namespace) -> int:
    """Record the model's step with :func:`dtr.zoo.record.record_model` and print one line about the log."""
    from dtr.zoo.record import record_model
    out = args.output
    entry = record_model(args.model, out, batch=args.batch, seed=args.seed, cost_model=args.cost_model,
                         warmup=args.warmup, options=dict(args.options), device=args.device, manifest=args.manifest)
    print(f"{entry['model']}: {entry['ops']} ops, peak {format_bytes(entry['peak_bytes'])} ({entry['peak_bytes']} B), "
          f"{entry['lines']} lines, {format_bytes(entry['bytes'])} -> {out}")
    return 0


#: The subcommands of this module.
COMMANDS = (record_command,)
