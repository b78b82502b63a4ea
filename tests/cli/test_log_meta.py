"""``dtr.budget(log_meta=...)``: only meta lines the log reader accepts are written.

log_meta becomes fields of the log's meta line, so what the reader refuses
there (docs/log-format.md) is refused before the block runs and before any
file is written: a number that is not finite, a field the log writes itself,
something that is not a dict of JSON values. A log_meta that passes replays.
"""
from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

import dtr  # noqa: E402
from dtr.cli import main  # noqa: E402
from dtr.sim.logs import read_log  # noqa: E402


@pytest.mark.parametrize("meta,error,what", [
    ({"x": float("nan")}, ValueError, "log_meta['x'] cannot be written as JSON"),
    ({"run": {"lr": float("inf")}}, ValueError, "log_meta['run']"),
    ({"op": "call"}, ValueError, "log_meta['op']: the log writes 'op' itself"),
    ({"version": 2}, ValueError, "log_meta['version']: the log writes 'version' itself"),
    ({"torch": "1.0"}, ValueError, "log_meta['torch']"),
    ({"cost_unit": "s"}, ValueError, "log_meta['cost_unit']"),
    ({"keep_needed": False}, ValueError, "log_meta['keep_needed']"),
    ([1, 2], TypeError, "log_meta must be a dict"),
    ({1: "a"}, TypeError, "log_meta's keys must be strings"),
    ({"model": object()}, TypeError, "log_meta must hold JSON values only"),
    ({"deep": functools.reduce(lambda v, _: [v], range(64), 0)}, ValueError, "more than 64 deep"),
    ({"s": "\ud800"}, ValueError, "lone surrogate"),
])
def test_a_log_meta_the_reader_would_refuse_is_refused_and_writes_nothing(tmp_path, meta, error, what):
    path = tmp_path / "step.jsonl"
    with pytest.raises(error) as e:
        dtr.budget(None, log=path, log_meta=meta)
    assert what in str(e.value), str(e.value)
    assert not path.exists()


def test_a_good_log_meta_reaches_the_meta_line_and_replays(capsys, tmp_path):
    path = tmp_path / "step.jsonl"
    meta = {"model": "tiny", "batch": 2, "lr": 1e-3, "tags": ["a", None, True],
            "deep": functools.reduce(lambda v, _: [v], range(63), 0)}  # (the reader's deepest nesting)
    with dtr.budget(None, log=path, log_meta=meta, cost_model="flops"):
        y = torch.ones(10) * 2
    assert y.sum().item() == 20
    assert {k: read_log(path).meta[k] for k in meta} == meta
    assert main(["replay", str(path)]) == 0
    assert "status         ok" in capsys.readouterr().out
