"""The prediction cache (dtr/runtime/prediction.py): output sizes from one meta run per op signature."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dtr.runtime.prediction import PredictionCache  # noqa: E402
from dtr.runtime.pytree import tree_flatten  # noqa: E402

aten = torch.ops.aten


def _predict(cache, func, *args, **kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    sig = (func, tuple((tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else x
                       for x in leaves))
    return cache.of_op(func, leaves, spec, sig)


def test_outputs_that_own_storage_are_sized_and_views_are_not():
    cache = PredictionCache()
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    p = _predict(cache, aten.mm.default, a, b)
    assert p.sizes == [3 * 7 * 4] and p.owning == [0] and p.metas[0].shape == (3, 7)
    v = _predict(cache, aten.view.default, a, [15])
    assert v.sizes == [] and v.owning == []  # a view owns nothing new
    two = _predict(cache, aten.max.dim, a, 1)  # (values, indices): two new storages
    assert two.sizes == [3 * 4, 3 * 8] and two.owning == [0, 1]


def test_data_dependent_sizes_are_unknown_and_cached():
    cache = PredictionCache()
    x = torch.tensor([0.0, 1.0, 2.0])
    p = _predict(cache, aten.nonzero.default, x)
    assert p.sizes is None and p.owning is None
    assert _predict(cache, aten.nonzero.default, x) is p and len(cache) == 1


def test_the_cache_is_bounded():
    cache = PredictionCache(limit=2)
    for n in range(1, 6):
        _predict(cache, aten.neg.default, torch.randn(n))
        assert 1 <= len(cache) <= 2


def test_a_factory_is_predicted_on_the_meta_device():
    cache = PredictionCache()
    sig = ("ones", 4)
    p = cache.of_factory(aten.ones.default, ([4, 4],), {"dtype": torch.float64, "device": torch.device("cpu")}, sig)
    assert p.sizes == [4 * 4 * 8] and p.owning == [0] and p.metas[0].is_meta
    assert cache.of_factory(aten.ones.default, ([9],), {}, sig) is p  # (by signature: the caller's key)
