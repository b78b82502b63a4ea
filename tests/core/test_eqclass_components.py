"""Eqclass's evicted components, worked out by hand: simrd's union-find against the exact split."""
from __future__ import annotations

import pytest

from dtr.core import Core


def _evicted_fork(c):
    """w (constant) -> m (1) -> l (2) -> p (1) and m -> r (8) -> q (1); m, l, r released.

    Returns (m, p, q). Eager eviction frees m, l and r as they are released:
    each joins its evicted neighbours.
    """
    w = c.constant(4)
    (m,) = c.call([w], [10], [-1], 1.0)
    (left,) = c.call([m], [10], [-1], 2.0)
    (r,) = c.call([m], [10], [-1], 8.0)
    (p,) = c.call([left], [10], [-1], 1.0)
    (q,) = c.call([r], [10], [-1], 1.0)
    for t in (m, left, r):
        c.release(t)
    return m, p, q


@pytest.mark.parametrize("split", [False, True], ids=["simrd", "split"])
def test_eqclass_component_splits_when_its_middle_comes_back(split):
    # w (constant) -> m (cost 1) -> l (cost 2) -> p (cost 1)
    #                   \-> r (cost 8) -> q (cost 1)
    # Releasing m, l and r evicts them: one component {m, l, r} of value 11,
    # next to p (through l) and q (through r). Recomputing m (its input w is
    # resident) takes it out. simrd's union-find only subtracts its cost: l
    # and r stay one component of value 10, so p and q each see 10. Split,
    # the component becomes {l} (2) and {r} (8), the exact evicted
    # neighbourhoods (what `dtr` computes). m itself sees both either way.
    c = Core("eqclass-split" if split else "eqclass")
    m, p, q = _evicted_fork(c)
    c.check()
    sp, sq, sm = (c.storage_of(t) for t in (p, q, m))
    assert (c.neighbourhood_cost(sp), c.neighbourhood_cost(sq)) == (11.0, 11.0)
    c.require(m)
    c.check()
    assert c.resident(sm) and c.counters["remats"] == 1
    want = (2.0, 8.0) if split else (10.0, 10.0)
    assert (c.neighbourhood_cost(sp), c.neighbourhood_cost(sq)) == want
    assert c.neighbourhood_cost(sm) == 10.0
    full = Core("dtr")  # the same steps under the exact e*
    m, p, q = _evicted_fork(full)
    full.require(m)
    assert (full.neighbourhood_cost(full.storage_of(p)), full.neighbourhood_cost(full.storage_of(q))) == (2.0, 8.0)


def _exact_components_cost(c, s):
    """e* as exact eqclass defines it: the costs of the evicted storages joined to s through evicted storages
    (along dependency edges either way), by brute force."""
    deps = [c.storage_deps(x) for x in range(c.num_storages)]
    nbrs = [list(d) for d in deps]
    for x, d in enumerate(deps):
        for y in d:
            nbrs[y].append(x)
    seen, stack = set(), [s]
    while stack:
        for y in nbrs[stack.pop()]:
            if y not in seen and y != s and not c.resident(y):
                seen.add(y)
                stack.append(y)
    return sum(c.storage_cost(y) for y in seen)


def test_eqclass_split_stays_exact_along_a_chain_and_under_a_budget():
    # A chain x0 -> x1 -> ... -> x7 (x_i costs i + 1, 10 bytes each), every
    # link but the last released at once (evicted): one component x0..x6 of
    # value 1 + ... + 7 = 28. Bringing x3 back recomputes x0, x1, x2 first
    # (its inputs): each leaves from the resident end of the component (the
    # O(1) case), and {x4, x5, x6} (5 + 6 + 7) is left. Then a tighter budget
    # evicts again: every neighbourhood stays the exact one.
    c = Core("eqclass-split", budget=200)
    w = c.constant(0)
    xs = [c.call([w], [10], [-1], 1.0)[0]]
    for i in range(1, 8):
        xs.append(c.call([xs[-1]], [10], [-1], float(i + 1))[0])
    for t in xs[:-1]:
        c.release(t)
    c.check()
    s7 = c.storage_of(xs[7])
    assert c.neighbourhood_cost(s7) == 28.0
    c.require(xs[3])
    c.check()
    assert [c.resident(c.storage_of(t)) for t in xs] == [True] * 4 + [False] * 3 + [True]
    assert c.neighbourhood_cost(s7) == 18.0 == c.neighbourhood_cost(c.storage_of(xs[3]))
    assert c.neighbourhood_cost(c.storage_of(xs[2])) == 0.0
    c.set_budget(60)  # 50 resident: the next 30 bytes evict at least two links
    c.call([w], [30], [-1], 1.0)
    c.check()
    assert c.counters["evictions"] >= 2
    for s in range(c.num_storages):
        if c.resident(s):
            assert c.neighbourhood_cost(s) == _exact_components_cost(c, s), s
