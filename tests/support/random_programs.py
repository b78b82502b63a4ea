"""Seeded random PyTorch programs for differential tests of the runtime against eager PyTorch.

A program is a list of instructions over named tensors: pointwise and matrix
ops, views (transposes, slices, reshapes, detach), in-place writes (through
views too, ``out=`` and ``index_put_``), random ops, concatenation,
reductions, ops with two outputs, ``no_grad`` regions, outputs whose size
depends on the data, control flow on ``.item()``, memory escaping through
``.numpy()``, BatchNorm's hidden writes to its running statistics, in-place
changes of view metadata (``t_``, ``transpose_``, ``unsqueeze_``), scatter
writes, bfloat16 autocast regions, a user-defined autograd Function,
``torch.utils.checkpoint``, factories and dropped names, random factories
(a program may start with one), sampling ops drawing from a generator the
program owns (``generator=``), ``torch.manual_seed`` and ``fork_rng`` between
ops, ``torch.save``/``torch.load``, ``pickle`` and ``copy.deepcopy`` round
trips of live tensors, sparse COO/CSR operands (written in place too), a
wrapper tensor subclass (TwoTensor) whose ops run on the plain tensors it wraps,
autoregressive loops that grow a cache (``cat``, or ``index_copy_`` into a
buffer) read at every step, with and without autograd, blocks nested in
the program's own (a library's ``dtr.budget`` around a few ops), escapes
(support.program_escapes: writes through a storage's data pointer, ``repr``,
``nn.Parameter`` of unseen, pinned or sparse tensors, meta tensors, packed
RNNs, CTC, batched gradients), and, with
``generate(seed, collectives=True)`` and a process group of one rank
initialized, collectives (an async ``all_reduce`` waited for after another op,
a functional one) whose results autograd saves, and with ``generate(seed,
resizes=True)`` matrix products through an "unsharded" copy of a weight whose
storage the program allocates and fills before each use and frees after it,
in the forward and in the backward (FSDP2's unsharded parameters).

:func:`generate` builds one instruction at a time, running each eagerly and
keeping only those PyTorch accepts, and retries until the program's backward
also runs, so every program it returns is valid plain PyTorch. :func:`run` executes a program, optionally
inside a context (a
``dtr.budget``), and returns what it computed; :func:`run_steps` runs it as
several training steps with an in-place SGD update, in one context per step
or one around all. :func:`leaf_and_grad_bytes` sizes budgets; support.same_values compares two runs'
results bit for bit.
"""
from __future__ import annotations

import contextlib
import copy
import io
import pickle
import random
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed import _functional_collectives as fc
from torch.testing._internal.two_tensor import TwoTensor

from support.program_escapes import ESCAPES
from support.program_functions import BINARY, INPLACE, LAYOUTS, UNARY, VIEWS, ScaledMul, Unsharded, block

__all__ = ["Instr", "Program", "Result", "generate", "make_leaves", "run", "run_steps", "leaf_and_grad_bytes"]

SHAPES = [(16, 16), (16, 32), (32, 16), (32, 32)]
KEEP = 3  # names the program still holds after its loss (run)
# The program's own torch.Generator (for generator= arguments), reseeded from the program's seed by _leaves.
_GENERATOR = torch.Generator()
# What a "nested" instruction opens: run(nested=f) sets f(ratio) -> a context (a dtr.budget inside the
# program's block, at ratio times its budget); empty: nothing (the eager reference).
_NESTED: List[Callable[[float], Any]] = []


class Instr(NamedTuple):
    """One instruction: ``kind`` (a key of _OPS), its output name (or None) and its arguments."""

    kind: str
    out: Optional[str]
    args: Tuple[Any, ...]


class Program(NamedTuple):
    seed: int
    params: Tuple[Tuple[int, int], ...]   # shapes of the leaves that require grad
    inputs: Tuple[Tuple[int, int], ...]   # shapes of the inputs
    instrs: Tuple[Instr, ...]


class Result(NamedTuple):
    loss: torch.Tensor
    grads: List[Optional[torch.Tensor]]
    values: Dict[str, torch.Tensor]   # the names the program still holds at the end, cloned after the context


def _exec(ins: Instr, env: Dict[str, torch.Tensor]) -> None:
    k, out, args = ins
    t = lambda n: env[n]  # noqa: E731
    if k == "unary":
        env[out] = UNARY[args[0]](t(args[1]))
    elif k == "binary":
        env[out] = BINARY[args[0]](t(args[1]), t(args[2]))
    elif k == "mm":
        env[out] = t(args[0]) @ t(args[1])
    elif k == "view":
        env[out] = VIEWS[args[0]](t(args[1]), *args[2:])
    elif k == "inplace":
        INPLACE[args[0]](*[t(n) for n in args[1:]])
    elif k == "dropout":
        env[out] = F.dropout(t(args[0]), p=args[1], training=True)
    elif k == "randn_like":
        env[out] = torch.randn_like(t(args[0])) + t(args[0])
    elif k == "cat":
        env[out] = torch.cat([t(args[0]), t(args[1])], dim=args[2])
    elif k == "sum":
        env[out] = t(args[0]).sum(dim=args[1], keepdim=True)
    elif k == "ones":
        env[out] = torch.ones(args[0]) * args[1]
    elif k == "max":  # an op with two outputs (values, indices); the indices pick rows of another tensor
        values, idx = t(args[0]).max(dim=1)
        env[out] = values.unsqueeze(1) + t(args[1]).index_select(0, idx % t(args[1]).shape[0])
    elif k == "index_put":  # a[rows] = b[rows], rows an integer tensor made inside the program
        rows = torch.arange(0, t(args[0]).shape[0], 3)
        t(args[0]).index_put_((rows,), t(args[1])[rows])
    elif k == "out":  # an out= op writing into an existing tensor
        torch.mul(t(args[1]), t(args[2]), out=t(args[0]))
    elif k == "no_grad":
        with torch.no_grad():
            env[out] = t(args[0]) * 3.0
    elif k == "expand":
        env[out] = t(args[0]).sum(0, keepdim=True).expand_as(t(args[0])) * t(args[0])
    elif k == "masked_select":  # an output whose size depends on the data
        a = t(args[0])
        picked = a.masked_select(a > 0)
        env[out] = a * (picked.sum() / (picked.numel() + 1))
    elif k == "where":
        env[out] = torch.where(t(args[0]) > 0, t(args[0]), t(args[1]))
    elif k == "cond":  # Python control flow on a value (.item())
        a = t(args[0])
        env[out] = a * 2.0 if a.sum().item() > 0 else a - 1.0
    elif k == "collective":  # memory a backend writes from its own thread (one rank: the sum is the value)
        a = t(args[1])
        c = a.detach() * 1.0
        if args[0] == "async":
            work = dist.all_reduce(c, async_op=True)
            d = a + 1.0  # an op while the backend may still be writing c
            work.wait()
            env[out] = d * c
        else:  # functional: an AsyncCollectiveTensor, waited for at its first use
            env[out] = a * fc.all_reduce(c, "sum", dist.group.WORLD)
    elif k == "numpy":  # memory that leaves PyTorch's view, read through from_numpy, maybe written there
        arr = t(args[0]).detach().numpy()
        env[out] = torch.from_numpy(arr) * 1.5
        if len(args) > 1 and args[1]:  # a write outside PyTorch (Note [Bytes written outside PyTorch])
            arr *= 0.5
    elif k == "batch_norm":  # writes the running statistics (constants) although its schema does not say so
        a = t(args[0])
        c = a.shape[1]
        env[out] = F.batch_norm(a, t(f"bn{c}_mean"), t(f"bn{c}_var"), training=True, momentum=0.1)
    elif k == "sort":  # two outputs, both used
        values, idx = t(args[0]).sort(dim=1)
        env[out] = values * (idx.float() + 1.0)
    elif k == "meta_inplace":  # in-place ops on a tensor's view metadata (no bytes written)
        a = t(args[1])
        if args[0] == "t_":
            a.t_()
        elif args[0] == "unsqueeze_squeeze_":
            a.unsqueeze_(0)
            env[out] = a * 1.0
            a.squeeze_(0)
        else:
            a.transpose_(0, 1)
    elif k == "scatter":  # in-place writes at data-dependent positions
        a = t(args[0])
        idx = t(args[1]).argsort(dim=1)[:, : a.shape[1]] % a.shape[1]
        a.scatter_(1, idx, t(args[1])[:, : a.shape[1]] * 0.5)
    elif k == "cumsum":
        env[out] = t(args[0]).cumsum(dim=1) * 0.1
    elif k == "autocast":  # a bfloat16 region (CPU autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = t(args[0]) @ t(args[1])
        env[out] = y.float()
    elif k == "function":
        env[out] = ScaledMul.apply(t(args[0]), t(args[1]))
    elif k == "unsharded":
        env[out] = Unsharded.apply(t(args[0]), t(args[1]))
    elif k == "checkpoint":  # torch.utils.checkpoint inside the budget: its recomputation goes through dtr too
        env[out] = torch.utils.checkpoint.checkpoint(block, t(args[0]), use_reentrant=False)
    elif k == "randn":  # a random factory (a program may start with one)
        env[out] = torch.randn(args[0]) * 0.5
    elif k == "sample":  # a sampling op on the program's own generator (or the default one)
        a, g = t(args[1]), (_GENERATOR if args[2] else None)
        if args[0] == "bernoulli":
            env[out] = torch.bernoulli(torch.sigmoid(a.detach()), generator=g) * a
        elif args[0] == "normal_":
            env[out] = torch.empty_like(a).normal_(generator=g) + a
        elif args[0] == "multinomial":  # rows picked at random
            idx = torch.multinomial(torch.softmax(a.detach(), dim=1), 2, replacement=True, generator=g)
            env[out] = a.gather(1, idx).sum(1, keepdim=True) * a
        elif args[0] == "randperm":
            env[out] = a[torch.randperm(a.shape[0], generator=g)]
        elif args[0] in ("exponential_", "geometric_"):  # in-place samplers (no meta kernel with generator=)
            e = torch.empty_like(a)
            (e.exponential_(generator=g) if args[0] == "exponential_" else e.geometric_(0.3, generator=g))
            env[out] = e.clamp(max=3.0) * a
        else:
            env[out] = torch.rand(a.shape, generator=g) * a
    elif k == "reseed":  # the default generator reseeded (or forked) between ops
        if args[0] == "manual_seed":
            torch.manual_seed(args[1])
            env[out] = F.dropout(t(args[2]), p=0.5, training=True)
        else:
            with torch.random.fork_rng():
                torch.manual_seed(args[1])
                y = F.dropout(t(args[2]), p=0.5, training=True)
            env[out] = y + F.dropout(t(args[2]), p=0.5, training=True)
    elif k == "serialize":  # a live tensor's bytes read outside the dispatcher, then used again
        a = t(args[1]).detach()
        if args[0] == "save":
            buf = io.BytesIO()
            torch.save(a, buf)
            buf.seek(0)
            b = torch.load(buf)
        elif args[0] == "pickle":
            b = pickle.loads(pickle.dumps(a))
        else:
            b = copy.deepcopy(a)
        env[out] = b * t(args[1])
    elif k == "sparse":  # a sparse operand (COO or CSR) made from a live tensor; written in place too
        a, b = t(args[1]), t(args[2])
        s = a.detach().relu()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            s = s.to_sparse() if args[0] == "coo" else s.to_sparse_csr()
        y = s @ b
        if args[3]:  # the sparse tensor changes after an op read it
            (s.values() if args[0] == "csr" else s).mul_(2.0)
            y = y + s @ b
        env[out] = y
    elif k == "subclass":  # a wrapper subclass over a live tensor: its handler runs the ops on what it wraps
        a = t(args[0]).detach().clone(memory_format=torch.contiguous_format)  # (TwoTensor: equal layouts)
        w = torch.tanh(TwoTensor(a, a * 0.5) * 1.5) + args[1]
        env[out] = w.a * w.b  # (plain tensors: what it wrapped, computed inside the block)
    elif k == "sums":  # a sum of k terms past the pin limit of a version chain (limits.MAX_VERSIONS)
        a, n = t(args[1]), args[2]
        if args[0] in ("inplace", "empty"):  # written in place: later writes are writes to a constant
            acc = (a[:0] if args[0] == "empty" else a) * 1.0  # (empty: a constant of no bytes once pinned)
            for i in range(n):
                acc.add_(acc if args[0] == "empty" else a, alpha=0.25 * (i % 3))
        else:  # a used n + 1 times: autograd sums its gradient n times (in place through the dispatch key)
            acc = a * 0.5
            for i in range(n):
                acc = acc + torch.tanh(a * (0.5 + 0.125 * i))
        env[out] = acc
    elif k == "decode":  # an autoregressive loop: a cache grown each step (cat or index_copy_), read at each
        a, how, steps, grad = t(args[0]), args[1], args[2], args[3]
        with (contextlib.nullcontext() if grad else torch.no_grad()):
            h = torch.tanh(a[:1] * 0.5)
            if how == "cat":
                cache = h * 1.0
            else:  # a buffer written in place, one row a step (a version chain past the pin limit)
                cache = torch.zeros(steps + 1, a.shape[1])
                cache.index_copy_(0, torch.tensor([0]), h)
            for i in range(steps):
                seen = cache if how == "cat" else cache[: i + 1]
                attn = torch.softmax(h @ seen.t() * 0.25, dim=-1)  # every step reads the whole cache
                h = torch.tanh(attn @ seen + h * 0.5)
                if how == "cat":
                    cache = torch.cat([cache, h], dim=0)
                else:
                    cache.index_copy_(0, torch.tensor([i + 1]), h)
        env[out] = cache
    elif k == "nested":  # a block inside the program's (a library's own dtr.budget), around a few ops
        with (_NESTED[0](args[1]) if _NESTED else contextlib.nullcontext()):
            env[out] = block(t(args[0])) * t(args[0])
    elif k in ("layout", "escape"):  # program_functions.LAYOUTS, program_escapes.ESCAPES: functions of a value
        env[out] = (LAYOUTS if k == "layout" else ESCAPES)[args[0]](t(args[1]))
    elif k == "del":
        del env[args[0]]
    else:
        raise ValueError(f"unknown instruction kind {k!r}")


def _pick(rng: random.Random, env: Dict[str, torch.Tensor], pred=lambda x: True) -> Optional[str]:
    names = [n for n, x in env.items() if pred(x)]
    return rng.choice(names) if names else None


_KINDS = ["unary", "binary", "mm", "view", "inplace", "dropout", "randn_like", "cat", "sum", "ones", "del", "max",
          "index_put", "out", "no_grad", "expand", "masked_select", "where", "cond", "numpy", "batch_norm", "sort",
          "meta_inplace", "scatter", "cumsum", "autocast", "function", "checkpoint", "randn", "sample", "reseed",
          "serialize", "sparse", "subclass", "sums", "decode", "nested", "layout", "escape"]
_WEIGHTS = [14, 12, 10, 14, 14, 5, 3, 4, 3, 2, 8, 3, 3, 3, 2, 2, 2, 2, 2, 1, 2, 2, 3, 2, 2, 2, 2, 2, 2, 4, 2, 2, 2, 2,
            3, 2, 2, 6, 5]


def _propose(rng: random.Random, env: Dict[str, torch.Tensor], fresh: Callable[[], str],
             collectives: bool = False, resizes: bool = False) -> Optional[Instr]:
    kinds, weights = (_KINDS + ["collective"], _WEIGHTS + [6]) if collectives else (_KINDS, _WEIGHTS)
    if resizes:
        kinds, weights = kinds + ["unsharded"], weights + [10]
    kind = rng.choices(kinds, weights=weights)[0]
    if kind == "randn":
        return Instr(kind, fresh(), (rng.choice(SHAPES),))
    a = _pick(rng, env)
    if a is None:
        return None
    if kind == "unary":
        return Instr(kind, fresh(), (rng.choice(sorted(UNARY)), a))
    if kind == "binary":
        b = _pick(rng, env, lambda x: x.shape == env[a].shape)
        return Instr(kind, fresh(), (rng.choice(sorted(BINARY)), a, b))
    if kind in ("mm", "unsharded"):
        b = _pick(rng, env, lambda x: x.dim() == 2 and env[a].dim() == 2 and x.shape[0] == env[a].shape[1])
        return None if b is None else Instr(kind, fresh(), (a, b))
    if kind == "view":
        v = rng.choice(sorted(VIEWS))
        extra: Tuple[Any, ...] = ()
        if v in ("rows", "cols"):
            n = env[a].shape[0 if v == "rows" else 1] if env[a].dim() == 2 else 0
            if n < 2:
                return None
            i = rng.randrange(0, n // 2)
            extra = (i, rng.randrange(i + 1, n + 1), rng.choice([1, 1, 2]))
        return Instr(kind, fresh(), (v, a) + extra)
    if kind == "inplace":
        f = rng.choice(sorted(INPLACE))
        if f in ("add_", "copy_"):  # (b may be a itself: a write that reads its target twice)
            b = _pick(rng, env, lambda x: x.shape == env[a].shape)
            return None if b is None else Instr(kind, None, (f, a, rng.choice([a, b, b])))
        return Instr(kind, None, (f, a))
    if kind == "dropout":
        return Instr(kind, fresh(), (a, rng.choice([0.1, 0.5])))
    if kind == "randn_like":
        return Instr(kind, fresh(), (a,))
    if kind == "cat":
        d = rng.randrange(2)
        b = _pick(rng, env, lambda x: x.dim() == 2 and env[a].dim() == 2 and x.shape[1 - d] == env[a].shape[1 - d])
        return None if b is None else Instr(kind, fresh(), (a, b, d))
    if kind == "sum":
        return Instr(kind, fresh(), (a, rng.randrange(env[a].dim()))) if env[a].dim() == 2 else None
    if kind in ("max", "index_put"):
        b = _pick(rng, env, lambda x: x.dim() == 2 and env[a].dim() == 2 and x.shape[1] == env[a].shape[1]
                  and (kind == "max" or x.shape == env[a].shape))
        return None if b is None or env[a].dim() != 2 else Instr(kind, fresh() if kind == "max" else None, (a, b))
    if kind == "out":  # torch.mul(b, c, out=a), where b or c may be a
        b = _pick(rng, env, lambda x: x.shape == env[a].shape)
        return None if b is None else Instr(kind, None, (a,) + rng.choice([(b, b), (a, b), (a, a)]))
    if kind == "meta_inplace":
        return Instr(kind, fresh(), (rng.choice(["t_", "unsqueeze_squeeze_", "transpose_"]), a)) \
            if env[a].dim() == 2 else None
    if kind == "scatter":
        b = _pick(rng, env, lambda x: x.dim() == 2 and env[a].dim() == 2 and x.shape[0] == env[a].shape[0]
                  and x.shape[1] >= env[a].shape[1])
        return None if b is None else Instr(kind, None, (a, b))
    if kind == "cumsum":
        return Instr(kind, fresh(), (a,)) if env[a].dim() == 2 else None
    if kind == "autocast":
        b = _pick(rng, env, lambda x: x.dim() == 2 and env[a].dim() == 2 and x.shape[0] == env[a].shape[1])
        return None if b is None else Instr(kind, fresh(), (a, b))
    if kind == "function":
        b = _pick(rng, env, lambda x: x.shape == env[a].shape)
        return Instr(kind, fresh(), (a, b))
    if kind == "checkpoint":
        return Instr(kind, fresh(), (a,))
    if kind == "sample":
        if env[a].dim() != 2 or not env[a].is_floating_point():
            return None
        return Instr(kind, fresh(), (rng.choice(["bernoulli", "normal_", "multinomial", "randperm", "rand",
                                                 "exponential_", "geometric_"]), a, rng.random() < 0.7))
    if kind in ("layout", "escape"):
        if env[a].dtype != torch.float32 or env[a].dim() != 2:
            return None
        return Instr(kind, fresh(), (rng.choice(sorted(LAYOUTS if kind == "layout" else ESCAPES)), a))
    if kind == "reseed":
        return Instr(kind, fresh(), (rng.choice(["manual_seed", "fork_rng"]), rng.randrange(1000), a))
    if kind == "serialize":
        return Instr(kind, fresh(), (rng.choice(["save", "pickle", "deepcopy"]), a))
    if kind == "sparse":
        b = _pick(rng, env, lambda x: x.dim() == 2 and env[a].dim() == 2 and x.shape[0] == env[a].shape[1]
                  and x.dtype == env[a].dtype == torch.float32)
        return None if b is None else Instr(kind, fresh(), (rng.choice(["coo", "csr"]), a, b, rng.random() < 0.3))
    if kind == "where":
        b = _pick(rng, env, lambda x: x.shape == env[a].shape)
        return Instr(kind, fresh(), (a, b))
    if kind == "collective":
        return Instr(kind, fresh(), (rng.choice(["async", "functional"]), a))
    if kind == "numpy":
        return Instr(kind, fresh(), (a, rng.random() < 0.5))
    if kind in ("masked_select", "cond", "sort"):
        return Instr(kind, fresh(), (a,))
    if kind == "subclass":
        return Instr(kind, fresh(), (a, rng.choice([0.0, 1.0])))
    if kind == "sums":
        if not env[a].is_floating_point() or env[a].dim() == 0:
            return None
        return Instr(kind, fresh(), (rng.choice(["inplace", "inplace", "grad", "grad", "empty"]), a,
                                     rng.choice([6, 9, 12])))
    if kind == "decode":
        if env[a].dim() != 2 or not env[a].is_floating_point():
            return None
        return Instr(kind, fresh(), (a, rng.choice(["cat", "index_copy"]), rng.choice([6, 12, 24]),
                                     rng.random() < 0.5))
    if kind == "nested":
        if not env[a].is_floating_point():
            return None
        return Instr(kind, fresh(), (a, rng.choice([None, 1.0, 0.9, 0.7])))
    if kind == "batch_norm":
        x = env[a]
        ok = x.dim() == 2 and x.shape[0] > 1 and all(f"bn{x.shape[1]}_{w}" in env for w in ("mean", "var"))
        return Instr(kind, fresh(), (a,)) if ok else None
    if kind in ("no_grad", "expand"):
        return Instr(kind, fresh(), (a,)) if env[a].dim() == 2 else None
    if kind == "ones":
        return Instr(kind, fresh(), (rng.choice(SHAPES), rng.choice([0.5, 2.0])))
    return Instr("del", None, (a,)) if len(env) > 4 else None


def _leaves(p: Program) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    _GENERATOR.manual_seed(p.seed + 1)
    g = torch.Generator().manual_seed(p.seed)
    params = [torch.randn(s, generator=g).requires_grad_() for s in p.params]
    inputs = [torch.randn(s, generator=g) for s in p.inputs]
    inputs += [torch.zeros(16), torch.ones(16), torch.zeros(32), torch.ones(32)]  # running statistics
    return params, inputs


def make_leaves(p: Program) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The program's (parameters, inputs), as :func:`run` makes them."""
    return _leaves(p)


def _env(params: List[torch.Tensor], inputs: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Names for the leaves: p* (parameters), x* (inputs), bn*_mean / bn*_var (running statistics, last inputs)."""
    env = {f"p{i}": x for i, x in enumerate(params)}
    env.update({f"x{i}": x for i, x in enumerate(inputs[:-4])})
    for (c, what), x in zip([(16, "mean"), (16, "var"), (32, "mean"), (32, "var")], inputs[-4:]):
        env[f"bn{c}_{what}"] = x
    return env


def _loss(env: Dict[str, torch.Tensor]) -> torch.Tensor:
    terms = [x.sum() * (1.0 / (k + 1)) for k, (n, x) in enumerate(sorted(env.items()))
             if x.requires_grad and x.is_floating_point()]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def run(p: Program, ctx: Optional[Any] = None, check: Optional[Callable[[], None]] = None,
        nested: Optional[Callable[[Optional[float]], Any]] = None,
        leaves: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None) -> Result:
    """Execute ``p`` (inside ``ctx`` if given): forward instructions, the loss and its backward.

    ``check()``, if given, runs after each instruction and after the backward
    (a block's ``_check``: its invariants between ops). ``nested(ratio)``
    makes the context of a "nested" instruction (a block inside ``ctx``; the
    ratio of its budget to the enclosing one, None for none); without it, the
    instruction opens nothing. ``leaves``: the program's (parameters,
    inputs) to use, as :func:`make_leaves` makes them (default: new ones).

    Raises whatever the program or the context raises.
    """
    params, inputs = leaves if leaves is not None else _leaves(p)
    _GENERATOR.manual_seed(p.seed + 1)
    torch.manual_seed(p.seed)
    _NESTED[:] = [nested] if nested is not None else []
    try:
        with (ctx if ctx is not None else contextlib.nullcontext()):
            loss, env = _step(p, params, inputs, check)
    finally:
        _NESTED.clear()
    values = {n: x.detach().clone() for n, x in env.items()}
    return Result(loss.detach().clone(), [None if q.grad is None else q.grad.clone() for q in params], values)


def _step(p: Program, params: List[torch.Tensor], inputs: List[torch.Tensor],
          check: Optional[Callable[[], None]] = None):
    """The instructions, the loss and its backward; (loss, the names the program still holds)."""
    env = _env(params, inputs)
    for ins in p.instrs:
        _exec(ins, env)
        if check is not None:
            check()
    loss = _loss(env)
    # The program keeps a few names; the rest lives on only in autograd's saved tensors.
    env = {n: env[n] for n in sorted(env)[-KEEP:]}
    if loss.requires_grad:
        loss.backward()
    if check is not None:
        check()
    return loss, env


def run_steps(p: Program, steps: int = 3, *, per_step: Optional[Callable[[], Any]] = None,
              around: Optional[Any] = None, lr: float = 0.01,
              check: Optional[Callable[[], None]] = None) -> List[Result]:
    """Execute ``p`` as ``steps`` training steps over the same leaves; one Result per step.

    Each step runs the instructions on the current parameters and inputs (the
    program's in-place writes to inputs carry over), adds the loss's gradients
    to the parameters' (never zeroed: accumulation across steps), then updates
    the parameters in place (SGD, under ``no_grad``). ``per_step()`` makes a
    context for each step; ``around`` is one context around all of them, and
    then only the last step's Result is complete (the others hold the loss).
    ``values`` also holds the parameters after the step's update. ``check``:
    as for :func:`run`, and after each update.
    """
    params, inputs = _leaves(p)
    torch.manual_seed(p.seed)
    out: List[Result] = []
    with (around if around is not None else contextlib.nullcontext()):
        for _ in range(steps):
            with (per_step() if per_step is not None else contextlib.nullcontext()):
                loss, env = _step(p, params, inputs, check)
                with torch.no_grad():
                    for q in params:
                        if q.grad is not None:
                            q.sub_(lr * q.grad)
                if check is not None:
                    check()
            if around is None:  # (after the step's own context: the copies are the test's, not the step's memory)
                out.append(_result(loss, params, env))
            else:  # inside the context: only the loss now, the rest after the last step
                out.append(Result(loss.detach().clone(), [], {}))
    if around is not None:
        out[-1] = _result(out[-1].loss, params, env)
    return out


def _result(loss: torch.Tensor, params: List[torch.Tensor], env: Dict[str, torch.Tensor]) -> Result:
    values = {n: x.detach().clone() for n, x in env.items()}
    values.update({f"param{i}": q.detach().clone() for i, q in enumerate(params)})
    return Result(loss.detach().clone(), [None if q.grad is None else q.grad.clone() for q in params], values)


def generate(seed: int, length: int = 60, attempts: int = 20, collectives: bool = False,
             resizes: bool = False) -> Program:
    """A valid random program: each kept instruction ran eagerly, and so did the loss's backward.

    With ``collectives``, its instructions include collectives over the default process group (which
    must be initialized, with one rank); with ``resizes``, products through storages the program resizes."""
    for attempt in range(attempts):
        rng = random.Random(f"{seed}/{attempt}")
        shapes = tuple(SHAPES)
        inputs = tuple(rng.choice(SHAPES) for _ in range(2))
        p = Program(seed, shapes, inputs, ())
        params, xs = _leaves(p)
        env = _env(params, xs)
        counter = iter(range(10 ** 6))
        instrs: List[Instr] = []
        torch.manual_seed(seed)
        if rng.random() < 0.3:  # a random factory as the block's first op
            first = Instr("randn", f"v{next(counter)}", (rng.choice(SHAPES),))
            _exec(first, env)
            instrs.append(first)
        for _ in range(20 * length):  # proposals (most are kept)
            if len(instrs) == length:
                break
            ins = _propose(rng, env, lambda counter=counter: f"v{next(counter)}", collectives, resizes)
            if ins is None:
                continue
            trial = dict(env)
            try:
                _exec(ins, trial)
                loss = _loss(trial)
                writes = ("inplace", "index_put", "out", "scatter", "meta_inplace")
                if ins.kind in writes and loss.requires_grad:  # it must not overwrite a saved tensor
                    torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
            except (RuntimeError, IndexError):  # a write autograd forbids, a view that cannot be taken, ...
                continue
            env = trial
            instrs.append(ins)
        if len(instrs) < length:
            continue
        p = p._replace(instrs=tuple(instrs))
        try:
            run(p)
        except RuntimeError:  # autograd refused the backward (a saved tensor was overwritten): try again
            continue
        return p
    raise RuntimeError(f"no valid program for seed {seed} in {attempts} attempts")


# ------------------------------------------------------------------ sizing budgets

def leaf_and_grad_bytes(p: Program) -> int:
    """Roughly what exists before the program: its leaves, and as much again for gradients (sets budgets)."""
    return sum(4 * r * c for r, c in p.params + p.inputs) * 2
