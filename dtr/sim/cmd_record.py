"""``dtr-sim record``: record one training step of a zoo model as a v1 log.

Light to import: torch and :mod:`dtr.zoo` are imported inside the command
function only (``dtr-sim replay`` must not load torch).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
from typing import Any, Dict, Tuple

from dtr.errors import DtrError
from dtr.sim.commands import command, int_type
from dtr.units import format_bytes

__all__ = ["update_manifest", "count_lines"]

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
    p.add_argument("--batch", type=int_type(1, 2**31 - 1, "--batch"), default=8, metavar="N", help="batch size (default: 8)")
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


def count_lines(path: str) -> int:
    """The number of lines of a log, gzip-compressed or not.

    Args:
        path: the log.

    Returns:
        Its line count.
    """
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        return sum(1 for _ in f)


def update_manifest(path: str, log_name: str, entry: Dict[str, Any]) -> None:
    """Set ``entry`` as the record of ``log_name`` in the manifest at ``path`` (created if absent).

    The manifest is ``{"version": 1, "logs": {LOG_FILE_NAME: entry, ...}}``,
    written with sorted keys so that updates give small diffs; the write
    replaces the file atomically.

    Args:
        path: the manifest file.
        log_name: the log's file name (its key).
        entry: the record (model, shapes, batch, seed, ...).

    Raises:
        DtrError: an existing manifest is not valid JSON of that form.
    """
    data: Dict[str, Any] = {"version": 1, "logs": {}}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError as e:
            raise DtrError(f"{path}: not a valid manifest ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("logs"), dict):
            raise DtrError(f"{path}: not a valid manifest (no 'logs' object)")
    data["logs"][log_name] = entry
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


@command("record", "record one training step of a zoo model as a v1 log", _record_args)
def _record(args: argparse.Namespace) -> int:
    import torch
    from torch.utils._pytree import tree_map

    import dtr
    from dtr import zoo

    if args.batch < 1:
        raise DtrError(f"--batch must be at least 1 (got {args.batch})")
    if args.warmup < 0:
        raise DtrError(f"--warmup must be >= 0 (got {args.warmup})")
    options = dict(args.options)
    try:
        zm = zoo.get_model(args.model, seed=args.seed, **options)
    except ImportError as e:
        raise DtrError(str(e)) from None
    except TypeError as e:
        raise DtrError(f"bad option for {args.model}: {e}") from None
    device = torch.device(args.device)
    model = zm.module.to(device)
    inputs, targets = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                               zm.batch(args.batch, args.seed))

    for k in range(args.warmup):
        torch.manual_seed(args.seed + 1 + k)
        model.zero_grad(set_to_none=True)
        zm.loss(model, inputs, targets).backward()
    model.zero_grad(set_to_none=True)

    out = args.output
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.manual_seed(args.seed)
    with dtr.budget(None, log=out, cost_model=args.cost_model, device=device,
                    log_meta={"model": args.model, "batch": args.batch}) as b:
        loss = zm.loss(model, inputs, targets)
        loss.backward()
    stats = b.stats

    lines, size = count_lines(out), os.path.getsize(out)
    manifest = args.manifest or os.path.join(os.path.dirname(os.path.abspath(out)), MANIFEST_NAME)
    update_manifest(manifest, os.path.basename(out), {
        "model": zm.name,
        "options": options,
        "shapes": dict(zm.shapes),
        "batch": args.batch,
        "seed": args.seed,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "device": str(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "cost_model": args.cost_model,
        "cost_unit": stats["cost_unit"],
        "lines": lines,
        "bytes": size,
        "peak_bytes": stats["peak_bytes"],
        "ops": stats["ops"],
        "base_compute": stats["base_compute"],
        "loss": float(loss.detach()),
    })
    print(f"{zm.name}: {stats['ops']} ops, peak {format_bytes(stats['peak_bytes'])} ({stats['peak_bytes']} B), "
          f"{lines} lines, {format_bytes(size)} -> {out}")
    return 0
