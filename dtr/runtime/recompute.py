"""Recipes and recomputation: what it takes to run a recorded op again, and running it.

The runtime records a Recipe for each op that produced or wrote a storage
(ReferencePath._commit, or the native path's commit); when the core decides to
recompute an op (its on_compute hook), the Recomputer runs that recipe again
over the storage versions it first read, and puts the results into the
versions' storages, which every tensor object of the program already views
(Note [Evicting storages in place] in driver.py). The recipes, keyed by core
op, are the Recomputer's: it renumbers them at compaction and drops those the
core collected.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from dtr.runtime.effects import overwrites_self
from dtr.runtime.pytree import tree_flatten, tree_unflatten
from dtr.runtime.storage_table import Buf, StorageTable, opaque, resize_storage

__all__ = ["CONJ", "NEG", "Recipe", "Recomputer", "RngStates", "Slot", "bits_of", "default_generator", "rng_capture",
           "old_values", "rng_state", "set_rng_state", "slot_of"]

# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage
_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # see Note [Adopting recomputed bytes]
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_get_default_dtype = torch.get_default_dtype
# Every device's autocast key (see Note [What a recomputation restores]).
_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
for _k in ("AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastIPU", "AutocastPrivateUse1",
           "AutocastMTIA", "AutocastXLA"):
    if hasattr(torch._C.DispatchKey, _k):
        _AUTOCAST = _AUTOCAST | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _k))
# The keys of vmap and of torch.func's transforms (see the same Note): a recomputation runs outside them.
# (torch._vmap_internals' VmapMode has no name in Python's DispatchKey: parsed from its C++ name)
_EXCLUDED = _AUTOCAST
for _k in ("VmapMode", "FuncTorchVmapMode", "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode"):
    _key = torch._C._parse_dispatch_key(_k)  # (None for a name this torch does not have)
    if _key is not None:
        _EXCLUDED = _EXCLUDED | torch._C.DispatchKeySet(_key)
_no_autocast = torch._C._ExcludeDispatchKeyGuard

# Note [Versions]
# The core sees one tensor per *version* of a physical storage. A view is not
# a new core tensor (it shares the storage, so it comes back with it). An
# in-place op creates a new version that takes over the buffer; the old version
# loses its bytes but stays recomputable into a fresh buffer if something
# evicted still needs the old value. Recorded ops refer to their inputs by
# version (a Slot), never by the tensor object, so a recomputation always reads
# the value the op originally read.
class Slot(NamedTuple):
    """A tensor argument or output of a recorded op: a view of one storage version."""

    tensor: int            # core tensor (storage version)
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    bits: int              # CONJ | NEG: the view's lazy conjugate and negative bits (Note [Lazy bits])


CONJ, NEG = 1, 2


def bits_of(x: torch.Tensor) -> int:
    """The lazy bits of ``x`` (Note [Lazy bits]): CONJ if ``x.is_conj()``, NEG if ``x.is_neg()``."""
    return (CONJ if x.is_conj() else 0) | (NEG if x.is_neg() else 0)


# Note [Lazy bits]
# torch.conj of a complex tensor, and the real view of a conjugate
# (x.conj().imag), are views with a bit set: the storage holds the plain
# values, and the ops that read the view conjugate or negate them as they
# read. A recomputation rebuilds each input from its storage (set_), which
# has no bits: the op then read the plain values, and recomputed a wrong
# result (an evicted tanh(x.conj() @ W) came back as tanh(x @ W)). So a slot
# records the bits and view() sets them again (torch._conj, torch._neg_view).


class Recipe(NamedTuple):
    """What it takes to run a recorded op again (see Note [Recipes and the cyclic GC])."""

    func: Any
    leaves: Tuple[Any, ...]  # flattened (args, kwargs), tensors replaced by Slots
    spec: Any
    outputs: Tuple[Tuple[int, Slot], ...]     # (flat output position, slot) of outputs that own a storage
    writes: Tuple[Tuple[int, int, int], ...]  # (leaf position, old version, new version or -1 for a constant)
    rng: Optional[Tuple[Tuple[torch.Generator, torch.Tensor], ...]]  # (generator, state before the op)
    grad: bool  # autograd's grad mode when the op ran (Note [What a recomputation restores])
    dtype: torch.dtype  # torch's default dtype when the op ran (the same Note)


# Note [What a recomputation restores]
# A recomputation must compute the bytes the op first computed, but it runs
# where the core needs them: often in backward, where autograd's grad mode is
# off, or at the end of the block, or when memory escapes (.tolist(), .numpy())
# outside any op. A recipe records the op below autograd and autocast, with its
# arguments as they reached it, so it replays the same way only in the same
# setting:
# - Grad mode. Below autograd most kernels ignore it, not all: on the CPU,
#   aten::mkldnn_rnn_layer (nn.LSTM) takes oneDNN's inference path when grad
#   mode is off, whose outputs differ in the last bits and whose workspace is
#   None (an LSTM's weight gradients differed from plain PyTorch's). A recipe
#   records it; a recomputation runs under it (below autograd, grad mode
#   records no graph).
# - Autocast. The recorded op is what autocast passed down, inputs already
#   cast; run again from the top of the dispatcher inside an autocast region
#   (where the program is when it reads a tensor or ends the block), a
#   float32 matmul recorded with autocast off came back computed in bfloat16.
#   A recomputation runs with every autocast key excluded.
# - vmap and torch.func's transforms. The recorded op is what a batching
#   rule or a transform passed down, on plain tensors. Run again from the top
#   inside a vmap (autograd's is_grads_batched backward runs under
#   torch._vmap_internals' vmap), a recomputed torch.randn met vmap's check
#   for random ops and raised. A recomputation runs with their keys excluded,
#   as the dispatch key's entry runs all of dtr's work below them.
# - The default dtype. Factories without dtype= and Python scalars promoted
#   against integer tensors take it: a tensor made while the program had set
#   float64 came back as float32 values converted. A recipe records it; a
#   recomputation sets it. It is also part of an op's signature (Python's
#   and the native path's), whose cached prediction of the outputs' sizes
#   it changes. torch's default dtype is process-wide: while such a
#   recomputation runs (only in a program that changed it inside a block),
#   another thread's factories see the recorded one.
# Random ops also replay their generators' states (Note [Random ops]). Other
# process-wide settings (torch.backends flags, the number of threads) are not
# recorded: a program that changes them between an op and its recomputation
# may get other bits.
#
# Note [Recipes and the cyclic GC]
# Recipes are the runtime's long-lived objects, one per op, and every container
# object that outlives a few ops makes Python's cyclic GC run more often and
# traverse more (no recipe is ever part of a cycle). So a recipe and its flatten
# spec hold tuples, never lists: the GC stops tracking a plain tuple of atoms
# (a spec, an op's empty writes are the shared ``()``), while it always
# tracks a list. On a chain of 9000 small ops (h = tanh(h @ w) * 0.5, 64x64,
# under budget(None)) the GC's share of the runtime's overhead went from about
# 6.6 to 3.2 us per op.


def _numel(size: Tuple[int, ...]) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _contiguous(size: Tuple[int, ...], stride: Tuple[int, ...]) -> bool:
    """``Tensor.is_contiguous()`` from a shape and strides (dimensions of size 1 may have any stride)."""
    expected = 1
    for d, st in zip(reversed(size), reversed(stride)):
        if d == 0:
            return True
        if d != 1 and st != expected:
            return False
        expected *= d
    return True


def slot_of(t: int, x: torch.Tensor) -> Slot:
    """The Slot of tensor ``x``, a view of core tensor ``t``."""
    # (storage_offset() is typed int | SymInt; it is never symbolic here: dtr sees concrete tensors)
    return Slot(t, x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype,  # type: ignore[arg-type]
                bits_of(x))


class Recomputer:
    """Holds the recipes and runs them again when the core recomputes (see the module's docstring).

    The native per-op path stores its recipes in ``recipes`` too (a slot it
    reads at a fixed offset, like the mode's: Note [The driver's slots] in driver.py).
    """

    __slots__ = ("core", "table", "recipes", "device")

    def __init__(self, core: Any, table: StorageTable) -> None:
        self.core = core
        self.table = table
        self.recipes: Dict[int, Recipe] = {}  # core op -> recipe
        self.device: Optional[torch.device] = None  # where dtr allocates its own buffers (the block's device)

    def collected(self, ops: Iterable[int]) -> None:
        """The core collected ``ops``: they never run again. O(len(ops))."""
        for op in ops:
            self.recipes.pop(op, None)

    def renumber(self, ops: Sequence[int], tensors: Sequence[int]) -> None:
        """Follow a core compaction (new ids, -1 if dropped); a recipe's op can still run, so all it names is kept."""
        def slot(x: Any) -> Any:
            return x._replace(tensor=tensors[x.tensor]) if isinstance(x, Slot) else x

        self.recipes = {ops[op]: r._replace(leaves=tuple([slot(x) for x in r.leaves]),
                                            outputs=tuple([(pos, slot(x)) for pos, x in r.outputs]),
                                            writes=tuple([(pos, tensors[old], new if new < 0 else tensors[new])
                                                          for pos, old, new in r.writes]))
                        for op, r in self.recipes.items()}

    def _check(self) -> None:
        """Assert that every recipe names a core op and core tensors. O(recipes).

        Raises:
            AssertionError: one does not (a bug in the runtime).
        """
        n_ops, n_tensors = self.core.num_ops, self.core.num_tensors
        for op, r in self.recipes.items():
            assert 0 <= op < n_ops, f"a recipe for op {op}, not a core op"
            slots = [x for x in r.leaves if isinstance(x, Slot)] + [x for _, x in r.outputs]
            assert all(0 <= x.tensor < n_tensors for x in slots), f"op {op}'s recipe names a tensor not in the core"
            assert all(0 <= old < n_tensors and new < n_tensors for _, old, new in r.writes), \
                f"op {op}'s recipe writes a tensor not in the core"

    def view(self, slot: Slot) -> torch.Tensor:
        """A tensor over ``slot``'s storage version (which must have its buffer), as the op saw it."""
        st = self.table.phys[self.core.storage_of(slot.tensor)].live()
        v = torch.empty(0, dtype=slot.dtype, device=st.device).set_(st, slot.offset, slot.size, slot.stride)
        if slot.bits:  # see Note [Lazy bits]
            if slot.bits & CONJ:
                v = torch._conj(v)
            if slot.bits & NEG:
                v = torch._neg_view(v)
        return v

    def refill(self, t: int) -> torch.UntypedStorage:
        """The storage of version t, with its bytes allocated (dtr's own buffer if the program dropped it)."""
        s = self.core.storage_of(t)
        n = self.core.storage_size(s)
        buf = self.table.phys.get(s)
        st = buf.get() if buf is not None else None
        # None: the program dropped it (see Note [Dropped buffers]), or the version is a banished one
        # (collected: its buffer went with it) that an op recomputed for its other outputs writes anyway;
        # the core frees it again as soon as the op ran.
        if st is None:
            st = torch.UntypedStorage(n, device=self.device)
            self.table.phys[s] = Buf(st, owned=True, dropped=True)
        elif st.nbytes() != n:
            resize_storage(st, n)
        return st

    def run(self, op: int) -> None:
        """Run recorded ``op`` again: the core's on_compute hook for a recomputation, its inputs resident.

        Its outputs' bytes land in their versions' storages (adopted or copied),
        an in-place write's old bytes are handed over or copied first, and a
        random op replays the generator states it first saw (Note [Random ops]).

        Raises:
            whatever the op raises; an output whose write was handed over is evicted again.
        """
        r = self.recipes[op]
        leaves = [self.view(x) if isinstance(x, Slot) else x for x in r.leaves]
        moved = []  # storages holding bytes handed over to this op
        for pos, old, new in r.writes:
            if new < 0:  # a constant's side effect: run it on a copy and drop it
                leaves[pos] = leaves[pos].clone()
            elif self.core.handed(self.core.storage_of(old)):  # the old bytes become the new version's
                leaves[pos] = self._hand_over(old, new, r.leaves[pos], self._overwrites_all(r, pos, new))
                moved.append(_storage(leaves[pos]))
            else:        # the new version starts as a copy of the old one (unless the op overwrites it all)
                st = self.refill(new)
                if not self._overwrites_all(r, pos, new):
                    st.copy_(self.table.phys[self.core.storage_of(old)].live())
                leaves[pos] = self.view(r.leaves[pos]._replace(tensor=new))
        args, kwargs = tree_unflatten(leaves, r.spec)
        # (the program's state is set inside the try that restores it: a KeyboardInterrupt, which lands
        # between any two bytecodes, right after set_rng_state left the generators at the op's old state)
        saved = rng_state(r.rng) if r.rng is not None else None
        grad, dtype = _is_grad_enabled(), _get_default_dtype()
        try:
            if r.rng is not None:  # replay the random op with the generator state it first saw
                set_rng_state(r.rng)
            if grad != r.grad:  # see Note [What a recomputation restores]
                _set_grad_enabled(r.grad)
            if dtype is not r.dtype:
                torch.set_default_dtype(r.dtype)
            with _no_autocast(_EXCLUDED):
                out = r.func(*args, **kwargs)
        except BaseException:
            for st in moved:  # the new version stays evicted; the core evicts the old one too
                resize_storage(st, 0)
            raise
        finally:
            if grad != r.grad:
                _set_grad_enabled(grad)
            if dtype is not r.dtype:
                torch.set_default_dtype(dtype)
            if saved is not None:
                set_rng_state(saved)
        flat = tree_flatten(out)[0]
        # A resident twin is dropped, and so is a banished sibling (the core frees it at once; it may be
        # collected, its buffer gone): keeping its bytes would be memory the core does not count.
        core = self.core
        back = []
        for pos, slot in r.outputs:
            s = core.storage_of(slot.tensor)
            if not core.resident(s) and not core.banished(s):
                back.append((slot, flat[pos]))
        # Adopt only fresh buffers, each once: never an input's (an op that aliased one this time).
        srcs = {_storage(o)._cdata for _, o in back}
        adopt = _SWAP and len(srcs) == len(back) and not any(
            isinstance(x, torch.Tensor) and not opaque(x) and _storage(x)._cdata in srcs for x in leaves)
        for slot, o in back:
            if not (adopt and self._adopt(slot, o)):
                if o.dtype != slot.dtype or tuple(o.shape) != slot.size:  # (never a silent conversion)
                    raise RuntimeError(f"dtr: recomputing {r.func} gave a {o.dtype} tensor of shape {tuple(o.shape)} "
                                       f"where it first gave {slot.dtype} of shape {slot.size}")
                self.refill(slot.tensor)
                self.view(slot).copy_(o)

    def _overwrites_all(self, r: Recipe, pos: int, new: int) -> bool:
        """Whether the recipe's write at leaf ``pos`` replaces every byte of ``new``'s storage."""
        x = r.leaves[pos]
        n = self.core.storage_size(self.core.storage_of(new))
        return pos == 0 and overwrites_self(r.func) and x.offset == 0 and \
            _contiguous(x.size, x.stride) and _numel(x.size) * x.dtype.itemsize == n

    def _hand_over(self, old: int, new: int, slot: Slot, overwrites_all: bool) -> torch.Tensor:
        """Move the old version's bytes into the new version's storage; the view the op writes.

        See the core's Note [Handing bytes over on recomputation]: nothing reads
        the old version after this op, and the core evicts it once the op ran
        (freeing nothing). O(1) with ``_swap_data_ptr_``; otherwise one copy,
        after which the old buffer is freed at once, so that memory matches the
        core's count before the op allocates.
        """
        core = self.core
        src = self.table.phys[core.storage_of(old)].live()
        s = core.storage_of(new)
        n = core.storage_size(s)
        buf = self.table.phys.get(s)
        dst = buf.get() if buf is not None else None
        if dst is None:  # the program dropped it (see Note [Dropped buffers])
            dst = torch.UntypedStorage(0, device=self.device)
            self.table.phys[s] = Buf(dst, owned=True, dropped=True)
        if _SWAP and dst.nbytes() == 0 and src.nbytes() == n:
            dst._swap_data_ptr_(src)  # type: ignore[attr-defined]  # (torch >= 2.12: see _SWAP)
        else:
            if dst.nbytes() != n:
                resize_storage(dst, n)
            if not overwrites_all:
                dst.copy_(src)
            resize_storage(src, 0)
        return self.view(slot._replace(tensor=new))

    # Note [Adopting recomputed bytes]
    # A recomputation runs the op as it first ran, so each output it brings back
    # has the layout the evicted version had. Rather than refill the version's
    # storage (resize_(n): fresh pages) and copy the new output into it (one more
    # pass over the bytes), the runtime swaps the new output's buffer into the
    # evicted storage (``UntypedStorage._swap_data_ptr_``: an evicted storage holds
    # 0 bytes, so the swap is allowed) and drops the now empty output. On the GPT
    # benchmark at 15% the copies and refills were 0.64 s of 1.42 s spent
    # recomputing. A layout mismatch, two outputs sharing one buffer, or a torch
    # without the method (2.11 has none) falls back to refill-and-copy, which holds
    # the op's outputs twice for a moment: the real peak can pass the budget by
    # them. Likewise a recomputed in-place op starts its new version as a copy of
    # the old one only if it reads it: a fill or in-place sampler (dropout's
    # bernoulli_) that covers its whole storage gets a fresh buffer
    # (effects.overwrites_self).
    def _adopt(self, slot: Slot, o: torch.Tensor) -> bool:
        """Move the recomputed output's bytes into the version's storage; False if its layout differs.

        See Note [Adopting recomputed bytes]. O(1): no copy, no allocation.
        """
        src = _storage(o)
        s = self.core.storage_of(slot.tensor)
        if src.nbytes() != self.core.storage_size(s) or o.storage_offset() != slot.offset \
                or tuple(o.shape) != slot.size \
                or tuple(o.stride()) != slot.stride or o.dtype != slot.dtype:
            return False
        st = self.table.phys[s].get()
        if st is None:  # the program dropped it (see Note [Dropped buffers])
            self.table.phys[s] = Buf(src, owned=True, dropped=True)
        elif st.nbytes() == 0:
            st._swap_data_ptr_(src)  # type: ignore[attr-defined]  # (torch >= 2.12: see _SWAP)
        else:
            return False
        return True


# Note [Random ops]
# A recomputed random op must draw exactly what it drew the first time. An op
# tagged nondeterministic_seeded draws from the torch.Generator passed to it
# (generator=) or, without one, from the default generator of the device it
# runs on (for a factory, the device it allocates on; CUDA's state is its
# philox seed and offset). Just before the op first runs, the state of each
# generator it may draw from is saved in its recipe; a recomputation sets
# those states, runs the op, and puts back the states the program's
# generators had, so neither the recomputed value nor the program's later
# draws depend on when (or whether) dtr recomputed. Saving the state right
# before each op makes torch.manual_seed, fork_rng and set_state between ops
# (they are not dispatched) harmless, and a block's first op is no exception.
# Every ATen op that takes a Generator carries the tag (checked by a test).

def default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (CPU's, or the accelerator's of that index)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    if hasattr(module, "_lazy_init"):
        module._lazy_init()
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


RngStates = Tuple[Tuple[torch.Generator, torch.Tensor], ...]  # (generator, its state) pairs


def rng_capture(func: Any, leaves: List[Any], device: torch.device) -> RngStates:
    """(generator, state) of each generator random op ``func`` may draw from, before it runs (Note [Random ops])."""
    gens = [x for x in leaves if isinstance(x, torch.Generator)]
    if not gens:
        gens = [default_generator(device)]
    return tuple([(g, g.get_state()) for g in gens])


def rng_state(states: RngStates) -> RngStates:
    """The current states of the generators in ``states``."""
    return tuple([(g, g.get_state()) for g, _ in states])


def set_rng_state(states: RngStates) -> None:
    """Set each generator in ``states`` to its state there."""
    for g, state in states:
        g.set_state(state)


# Note [Writes to constants that allocate]
# A recipe runs an op's write to a constant on a copy of the constant
# (Recomputer.run), and that copy holds the constant's value when the op is
# recomputed: after the write. An op whose outputs depend on the value it
# overwrote (a custom op that scales its argument in place and returns a new
# tensor computed from it) then recomputed them from the new value. So when
# an op that writes a constant also allocates, the values the written
# constants had before it are kept (a copy, made just before the op runs) and
# its recipe reads those instead. The copies are not counted against the
# budget: the usual such op is batch norm in training, whose writes are its
# running statistics (a few floats per channel). A copy lives as long as the
# recipe.
def old_values(leaves: List[Any], writes: Sequence[Tuple[int, int]]) -> Dict[int, torch.Tensor]:
    """Leaf position -> a copy of each written constant's value before the op (Note [Writes to constants that
    allocate])."""
    return {pos: leaves[pos].clone() for pos, _ in writes}
