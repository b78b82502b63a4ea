"""Recording one training step of a zoo model as a v1 log, and the logs' manifest.

:func:`record_model` is what ``dtr-sim record`` runs: it builds a zoo model,
runs warm-up steps outside dtr, records one step under ``dtr.budget(None,
log=...)`` and sets the log's entry in the manifest next to it
(:func:`update_manifest`).

Importing this module imports torch (as all of :mod:`dtr.zoo` does): the
command line imports it inside ``dtr-sim record`` only.
"""
from __future__ import annotations

import datetime
import gzip
import json
import os
from typing import Any, Dict, Mapping, Optional

import torch
from torch.utils._pytree import tree_map

from dtr.errors import DtrError
from dtr.runtime.budget import budget
from dtr.runtime.budget_args import check_device
from dtr.zoo.registry import check_options, get_model

__all__ = ["MANIFEST_NAME", "record_model", "update_manifest", "count_lines"]

#: The manifest's file name, next to the logs it describes (logs/MANIFEST.json).
MANIFEST_NAME = "MANIFEST.json"


def record_model(model: str, output: str, *, batch: int = 8, seed: int = 0, cost_model: str = "flops",
                 warmup: int = 1, options: Optional[Mapping[str, Any]] = None, device: str = "cpu",
                 manifest: Optional[str] = None) -> Dict[str, Any]:
    """Record one training step of zoo model ``model`` as a v1 log and update the manifest.

    The step runs under ``dtr.budget(None, log=output)``: no eviction, every
    op logged. ``warmup`` training steps run before it, outside dtr. Seeds:
    the weights and the batch use ``seed``; warm-up step ``k`` seeds torch
    with ``seed + 1 + k``, the recorded step with ``seed``.

    Args:
        model: a zoo model name (see :func:`dtr.zoo.model_names`).
        output: the log to write (``.gz`` compresses); its directory is created.
        batch: the batch size, at least 1.
        seed: seed of the weights, the batch and the step's dropout.
        cost_model: op costs in the log: ``"flops"`` (deterministic) or ``"time"``.
        warmup: training steps run outside dtr before the recorded one, at least 0.
        options: keyword arguments of the model's factory (e.g. ``depth=40``).
        device: the torch device.
        manifest: the manifest to update; default: :data:`MANIFEST_NAME` next to ``output``.

    Returns:
        The manifest entry written for the log (``model``, ``ops``,
        ``peak_bytes``, ``lines``, ``bytes``, ``loss``, ...).

    Raises:
        DtrError: an unknown model, a bad option, a model whose extra
            dependency is missing, a bad batch or warm-up count, or an
            existing manifest that is not valid.
    """
    if batch < 1:
        raise DtrError(f"the batch size must be at least 1 (got {batch})")
    if warmup < 0:
        raise DtrError(f"the number of warm-up steps must be >= 0 (got {warmup})")
    options = dict(options or {})
    try:
        if "seed" in options:
            raise ValueError(f"bad option for {model}: the seed is not a model option: give it as seed= "
                             f"(dtr-sim record --seed)")
        check_options(model, options)  # names the option and what it takes (or the valid names)
    except (TypeError, ValueError) as e:
        raise DtrError(str(e)) from None
    try:
        zm = get_model(model, seed=seed, **options)
    except ImportError as e:
        raise DtrError(str(e)) from None
    except (TypeError, ValueError, RuntimeError) as e:  # the factory's own checks (or torch's) on these options
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "the defaults"
        raise DtrError(f"bad option for {model} ({shown}): {e}") from None
    try:
        dev = check_device(device)
    except ValueError as e:
        raise DtrError(str(e)) from None
    module = zm.module.to(dev)
    inputs, targets = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, zm.batch(batch, seed))

    for k in range(warmup):
        torch.manual_seed(seed + 1 + k)
        module.zero_grad(set_to_none=True)
        zm.loss(module, inputs, targets).backward()
    module.zero_grad(set_to_none=True)

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    torch.manual_seed(seed)
    with budget(None, log=output, cost_model=cost_model, device=dev,
                log_meta={"model": model, "batch": batch}) as b:
        loss = zm.loss(module, inputs, targets)
        loss.backward()
    stats = b.stats

    entry = {
        "model": zm.name,
        "options": options,
        "shapes": dict(zm.shapes),
        "batch": batch,
        "seed": seed,
        "warmup": warmup,
        "torch": torch.__version__,
        "device": str(dev),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "cost_model": cost_model,
        "cost_unit": stats["cost_unit"],
        "lines": count_lines(output),
        "bytes": os.path.getsize(output),
        "peak_bytes": stats["peak_bytes"],
        "ops": stats["ops"],
        "base_compute": stats["base_compute"],
        "loss": float(loss.detach()),
    }
    manifest = manifest or os.path.join(os.path.dirname(os.path.abspath(output)), MANIFEST_NAME)
    update_manifest(manifest, os.path.basename(output), entry)
    return entry


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
