"""One Semantics value and one thrash-limit rule for the runtime, the simulator and the command line."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import dtr
from dtr.core import Core, make_config
from dtr.errors import LogFormatError, ThrashingError
from dtr.semantics import RUNTIME, SIMRD, Semantics, check_thrash_limit, remat_allowance
from dtr.sim import parse_text, read_log, replay
from dtr.sim.chain import chain_budget, chain_log
from dtr.sim.sweep import sweep

FIELDS = Semantics.fields()


def test_fields_are_the_dataclass_fields_and_the_presets_are_all_off_or_all_on():
    assert FIELDS == ("free_dead_constants", "keep_needed", "eqclass_split", "inplace_handover", "deep_first")
    assert not any(getattr(SIMRD, f) for f in FIELDS) and all(getattr(RUNTIME, f) for f in FIELDS)


@pytest.mark.parametrize("bits", list(itertools.product([False, True], repeat=5)))
def test_meta_round_trip(bits):
    s = Semantics(*bits)
    assert Semantics.from_meta(s.to_meta()) == s
    assert Semantics.from_meta({**s.to_meta(), "model": "x"}) == s  # other meta fields are not semantics


def test_a_meta_line_without_semantics_is_simrds():
    assert Semantics.from_meta({"op": "meta", "version": 1}) == SIMRD


@pytest.mark.parametrize("field", FIELDS)
def test_a_field_that_is_not_a_bool_is_refused_by_name(field):
    with pytest.raises(ValueError, match=f"meta field '{field}' must be true or false"):
        Semantics.from_meta({field: 1})
    with pytest.raises(TypeError, match=f"Semantics.{field} must be True or False"):
        Semantics(**{field: "yes"})
    meta = json.dumps({"op": "meta", "version": 1, field: "no"})
    with pytest.raises(LogFormatError, match=f"{field}"):
        parse_text(meta + "\n")


def test_replace_changes_only_what_it_is_given():
    s = RUNTIME.replace(eqclass_split=False, keep_needed=None)
    assert s == Semantics(True, True, False, True, True)
    with pytest.raises(TypeError, match="unknown semantics field.*valid: free_dead_constants"):
        SIMRD.replace(keep_neded=True)


def test_make_config_takes_one_semantics_value():
    sem = make_config("lru", 100, semantics=RUNTIME.replace(deep_first=False)).semantics
    assert (sem.free_dead_constants, sem.keep_needed, sem.eqclass_split, sem.inplace_handover,
            sem.deep_first) == (True, True, True, True, False)
    assert make_config("eqclass-split", semantics=SIMRD).semantics.eqclass_split  # the heuristic's own split
    with pytest.raises(TypeError, match="semantics must be a dtr.semantics.Semantics"):
        make_config("lru", semantics={"keep_needed": True})
    with pytest.raises(TypeError):
        Core("lru", keep_needed=True)  # the switches no longer travel one by one


@pytest.mark.parametrize("eqclass_split", [True, False])
def test_a_runtime_log_records_the_runtimes_semantics(tmp_path, eqclass_split):
    path = tmp_path / "step.jsonl"
    with dtr.budget(None, log=path, cost_model="flops", eqclass_split=eqclass_split) as b:
        (torch.ones(4) * 2).sum()
    assert b.semantics == RUNTIME.replace(eqclass_split=eqclass_split)
    log = read_log(path)
    assert log.semantics == b.semantics
    assert {k: log.meta[k] for k in FIELDS} == b.semantics.to_meta()


# ------------------------------------------------------------ the thrash limit

@pytest.mark.parametrize("value,expected", [(1, 1.0), (3, 3.0), (2.5, 2.5), (None, math.inf), (math.inf, math.inf),
                                            (10 ** 400, math.inf)])  # (past a float's range: an OverflowError)
def test_thrash_limits_that_are_accepted(value, expected):
    assert check_thrash_limit(value) == expected


@pytest.mark.parametrize("value", [0.99, 0, -1, math.nan, "3", True, -10 ** 400])
def test_thrash_limits_are_refused_the_same_way_by_every_driver(value, tmp_path):
    words = "the thrash limit must be a number >= 1"
    with pytest.raises(ValueError, match=words):
        check_thrash_limit(value)
    with pytest.raises(ValueError, match=words):
        dtr.budget(None, thrash_limit=value)
    log = parse_text(chain_log(8))
    with pytest.raises(ValueError, match=words):
        replay(log, "dtr", None, thrash_limit=value)
    if not isinstance(value, str):
        path = tmp_path / "chain.jsonl"
        path.write_text(chain_log(8))
        with pytest.raises(ValueError, match=words):
            sweep([path], "dtr", [0.5], thrash_limit=value)


def test_remat_allowance():
    assert remat_allowance(3.0, 10.0) == 20.0
    assert remat_allowance(1.0, 10.0) == 0.0
    assert remat_allowance(math.inf, 10.0) == math.inf
    assert remat_allowance(2.0, 0.0) == math.inf  # nothing has cost anything: nothing recomputed can


def test_a_thrash_limit_of_one_allows_no_recomputation_in_both_drivers():
    n = 64
    log = parse_text(chain_log(n))
    r = replay(log, "dtr", chain_budget(n, "sqrt"), thrash_limit=1, banish=True)
    assert r.status == "thrash" and r.remats == 1  # the first recomputation passes the limit
    assert replay(log, "dtr", chain_budget(n, "sqrt"), thrash_limit=50, banish=True).status == "ok"

    x = torch.randn(256, 256)
    with pytest.raises(ThrashingError):
        with dtr.budget(6 * x.nbytes, cost_model="flops", thrash_limit=1):
            h = [x]
            for _ in range(12):
                h.append(torch.tanh(h[-1]))
            sum(t.sum() for t in h).item()
