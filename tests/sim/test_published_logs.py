"""The three logs published with the DTR paper, against the reference simulator's figures.

Skipped when ../shared/simrd-logs is absent; the logs are never copied into
the project. Expected figures are read from REFERENCE.md next to the logs.
"""
from __future__ import annotations

import re

import pytest

from dtr.core import ReplayStatus
from dtr.sim import read_log, replay
from dtr.sim.replay import baseline

LOGS = ("resnet32", "transformer", "lstm")


def reference_table(path):
    """{(log, heuristic, ratio): (overhead, status)} from REFERENCE.md."""
    table, log, ratios = {}, None, None
    for line in path.read_text().splitlines():
        m = re.match(r"## (\w+):", line)
        if m:
            log = m.group(1)
        elif line.startswith("| heuristic"):
            ratios = [float(x) for x in line.strip("|").split("|")[1:]]
        elif line.startswith("| ") and log and ratios and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for ratio, cell in zip(ratios, cells[1:]):
                if cell != "–":
                    overhead, status = cell.split()
                    table[(log, cells[0], ratio)] = (float(overhead), status.lower())
    return table


@pytest.fixture(scope="module")
def reference(request):
    from conftest import SIMRD_LOGS
    if not (SIMRD_LOGS / "REFERENCE.md").exists():
        pytest.skip("the published simrd logs (../shared/simrd-logs) are not present")
    return reference_table(SIMRD_LOGS / "REFERENCE.md"), {name: read_log(SIMRD_LOGS / f"{name}.log.gz")
                                                          for name in LOGS}


def test_reference_table_was_read(reference):
    table, _ = reference
    assert len(table) >= 80


@pytest.mark.parametrize("name", LOGS)
def test_baseline_figures(reference, name, simrd_logs):
    text = (simrd_logs / "REFERENCE.md").read_text()
    m = re.search(rf"## {name}: peak (\d+) MB without eviction, constants (\d+) MB, largest single op (\d+) MB, "
                  rf"base compute (\d+) ms", text)
    peak, const, largest, base = map(int, m.groups())
    raw = baseline(reference[1][name])
    assert round(raw["peak_memory"] / 1e6) == peak
    assert round(raw["constant_bytes"] / 1e6) == const
    assert round(raw["largest_op_bytes"] / 1e6) == largest
    assert round(raw["base_total"] / 1e6) == base


@pytest.mark.parametrize("heuristic", ["eqclass", "dtr", "local", "lru"])
@pytest.mark.parametrize("name", LOGS)
def test_matches_reference_simulator(reference, name, heuristic):
    """Succeeds wherever the reference did, with overhead at most 2% above it."""
    table, logs = reference
    log = logs[name]
    peak = baseline(log)["peak_memory"]
    checked = 0
    for (lname, h, ratio), (ref_overhead, ref_status) in table.items():
        if lname != name or h != heuristic:
            continue
        r = replay(log, heuristic, int(peak * ratio), thrash_limit=2.0, baseline_peak=peak)
        if ref_status == ReplayStatus.OK:
            assert r.status == ReplayStatus.OK, (name, heuristic, ratio, r.status)
            assert r.overhead <= ref_overhead * 1.02 + 1e-3, (name, heuristic, ratio, r.overhead, ref_overhead)
        checked += 1
    assert checked >= 6
