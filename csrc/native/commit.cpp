// commit.cpp - what runs after the op (ReferencePath._commit in dtr/runtime/reference.py) on the native per-op path:
// mode_commit, as named steps in the reference's order.
#include "fastpath.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace dtr::native {
namespace {

// What mode_commit's steps make for the later ones.
struct Commit {
  OpCall& call;
  long new_written;   // the version the op wrote, unless it is a constant's (no new version follows it), or -1
  PyObject* handle;   // the table's handle map (borrowed)
  Ref out_slots;      // ((position, Slot), ...) of the outputs that own a new storage
  std::vector<Ref> out_handles;  // (the new tensors' handles, in order)
  long new_version = -1;         // an in-place op's: the written storage's new version (reference.py's _commit: its writes)
  Ref written_handle;            // the handle of the storage it wrote
  PyObject* recorder = nullptr;  // the mode's recorder (borrowed), or None
};

// A Slot(tensor, offset, size, stride, dtype, bits) of x, a view of core tensor t (recompute.Slot, a NamedTuple: a
// tuple of its class; bits as recompute.bits_of).
PyObject* new_slot(long t, const at::Tensor& x, PyObject* size, PyObject* stride, PyObject* dtype) {
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(env.slot_type);
  PyObject* s = type->tp_alloc(type, 6);
  if (s == nullptr) return nullptr;
  PyObject* a = cached_int(t);
  PyObject* b = PyLong_FromLongLong(x.storage_offset());
  PyObject* bits = cached_int((x.is_conj() ? 1 : 0) | (x.is_neg() ? 2 : 0));  // (recompute.bits_of)
  if (a == nullptr || b == nullptr || bits == nullptr) {
    Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(bits); Py_DECREF(s);
    return nullptr;
  }
  Py_INCREF(size); Py_INCREF(stride); Py_INCREF(dtype);
  PyTuple_SET_ITEM(s, 0, a); PyTuple_SET_ITEM(s, 1, b); PyTuple_SET_ITEM(s, 2, size);
  PyTuple_SET_ITEM(s, 3, stride); PyTuple_SET_ITEM(s, 4, dtype); PyTuple_SET_ITEM(s, 5, bits);
  untrack(s);  // see Note [Untracked records] in py_object.h
  return s;
}

// The op's flattened output at position pos, if it is a tensor.
const at::Tensor* output_at(const Scratch& scratch, int pos) {
  if (scratch.outs_on_stack)
    return pos < static_cast<int>(scratch.touts.size()) && scratch.touts[pos].defined() ? &scratch.touts[pos]
                                                                                         : nullptr;
  PyObject* o = pos < static_cast<int>(scratch.flat.size()) ? scratch.flat[pos] : nullptr;
  return o != nullptr && THPVariable_Check(o) ? &THPVariable_Unpack(o) : nullptr;
}

// The handles of core tensors ts (a new list); one not in ``handle`` is skipped, or a KeyError.
Ref handles_of(PyObject* handle, const std::vector<long>& ts, bool skip_missing) {
  Ref l(PyList_New(0));
  if (!l) return Ref();
  for (long t : ts) {
    Ref tk(cached_int(t));
    PyObject* h = tk ? PyDict_GetItemWithError(handle, tk.get()) : nullptr;
    if (h == nullptr) {
      if (PyErr_Occurred() || !tk) return Ref();
      if (skip_missing) continue;
      PyErr_Format(PyExc_KeyError, "%ld", t);
      return Ref();
    }
    if (PyList_Append(l.get(), h) < 0) return Ref();
  }
  return l;
}

// The core's new tensors, and each output that owns a new storage in the table (StorageTable.add) with its
// (position, Slot) for the recipe.
bool commit_register_outputs(Commit& c) {
  FastPath* f = c.call.f;
  Entry* e = c.call.e;
  Scratch& scratch = c.call.scratch;
  std::vector<int>& outs = scratch.outs;
  outs.assign(e->sizes.size() + 1 + (c.new_written >= 0), -1);
  int n_outs = api->op_outputs(f->c, c.call.op, outs.data(), static_cast<int>(outs.size()));
  if (n_outs < 0) return false;
  std::vector<long>& new_tensors = scratch.new_tensors;
  for (size_t k = 0; k < e->sizes.size(); ++k) new_tensors.push_back(outs[k]);
  c.out_slots = Ref(PyTuple_New(static_cast<Py_ssize_t>(e->owning.size())));
  if (!c.out_slots) return false;
  c.out_handles.reserve(e->owning.size());
  for (size_t k = 0; k < e->owning.size(); ++k) {
    int pos = e->owning[k];
    const at::Tensor* otp = output_at(scratch, pos);
    if (otp == nullptr) {
      PyErr_Format(PyExc_RuntimeError, "dtr internal error: output %d of %R is not a tensor; please report this",
                   pos, c.call.func);
      return false;
    }
    const at::Tensor& ot = *otp;
    if (!ot.has_storage()) {
      PyErr_Format(PyExc_RuntimeError, "dtr: output %d of %R has no storage; run with DTR_NATIVE=0 and please "
                   "report this", pos, c.call.func);
      return false;
    }
    c10::StorageImpl* impl = ot.storage().unsafeGetStorageImpl();
    if (static_cast<int64_t>(impl->nbytes()) != e->sizes[k]) {
      Ref got(PyLong_FromSize_t(impl->nbytes())), want(PyLong_FromLongLong(e->sizes[k]));
      PyObject* a[3] = {c.call.func, got.get(), want.get()};
      Ref w(PyObject_Vectorcall(env.size_warning, a, 3, nullptr));
      if (!w) return false;
    }
    long t = new_tensors[k];
    int st = storage_of(f, t);
    if (st < 0) return false;
    Ref buf(new_weak_buf(impl));
    if (!buf) return false;
    Ref h(table_add(f, t, st, impl, buf.get()));
    if (!h) return false;
    c.out_handles.push_back(std::move(h));
    Ref size(e->out_layout(k, 0, ot.sizes())), stride(e->out_layout(k, 1, ot.strides()));
    if (!size || !stride) return false;
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(ot.scalar_type()));
    Ref slot(new_slot(t, ot, size.get(), stride.get(), dtype));
    Ref p(PyLong_FromLong(pos));
    if (!slot || !p) return false;
    PyObject* pair = PyTuple_Pack(2, p.get(), slot.get());
    if (pair == nullptr) return false;
    untrack(pair);
    PyTuple_SET_ITEM(c.out_slots.get(), k, pair);
  }
  return true;
}

// An in-place op's write: the new version takes the written storage's buffer (StorageTable.write), or, for
// a constant, nothing changes (reference.py's const_writes: it keeps its version and buffer). Either way, the
// written storage's handle, for the log.
bool commit_write_version(Commit& c) {
  const OpCall& call = c.call;
  if (call.written < 0) return true;
  if (call.to_constant) {
    Ref k(cached_int(call.written));
    PyObject* h = k ? PyDict_GetItemWithError(c.handle, k.get()) : nullptr;
    if (h == nullptr) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%ld", call.written);
      return false;
    }
    c.written_handle = borrowed(h);
    return true;
  }
  c.new_version = call.scratch.outs[call.e->sizes.size()];
  int old_st = storage_of(call.f, call.written), new_st = storage_of(call.f, c.new_version);
  if (old_st < 0 || new_st < 0) return false;
  const at::Tensor& written = THPVariable_Unpack(call.scratch.scan.leaves[0].obj);
  c.written_handle = table_write(call.f, call.written, c.new_version, old_st, new_st, written);
  return static_cast<bool>(c.written_handle);
}

// The op's line in the log (the recorder's call): its name, the handles it read and made, their sizes, its
// cost, and the handle it wrote.
bool commit_record(Commit& c) {
  const OpCall& call = c.call;
  const Entry* e = call.e;
  Ref sizes_list(PyList_New(static_cast<Py_ssize_t>(e->sizes.size())));
  Ref cost_obj(PyFloat_FromDouble(call.cost));
  if (!sizes_list || !cost_obj) return false;
  for (size_t k = 0; k < e->sizes.size(); ++k) {
    PyObject* x = PyLong_FromLongLong(e->sizes[k]);
    if (x == nullptr) return false;
    PyList_SET_ITEM(sizes_list.get(), k, x);
  }
  Ref in_h = handles_of(c.handle, call.scratch.ins, false);  // (rare: a log is recorded)
  Ref out_h = handles_of(c.handle, call.scratch.new_tensors, false);
  Ref mutated(PyList_New(0));
  if (mutated && c.written_handle && PyList_Append(mutated.get(), c.written_handle.get()) < 0) return false;
  Ref kw(PyDict_New());
  if (!in_h || !out_h || !mutated || !kw || PyDict_SetItem(kw.get(), names.mutated, mutated.get()) < 0)
    return false;
  Ref meth(PyObject_GetAttr(c.recorder, names.call));
  Ref a(PyTuple_Pack(5, call.info->name.get(), in_h.get(), out_h.get(), sizes_list.get(), cost_obj.get()));
  if (!meth || !a) return false;
  Ref r(PyObject_Call(meth.get(), a.get(), kw.get()));
  return static_cast<bool>(r);
}

// The handles this op read and made, for the next ops' polls (Liveness.saw).
bool commit_saw(Commit& c) {
  Ref hs = handles_of(c.handle, c.call.scratch.ins, true);
  if (!hs) return false;
  for (const Ref& h : c.out_handles)
    if (PyList_Append(hs.get(), h.get()) < 0) return false;
  return liveness_saw(c.call.f, std::move(hs));
}

// The op's recipe (recompute.Recipe), under its core op in the recomputer's recipes: the op, its leaves with
// each tensor as a Slot of its core tensor, its flatten spec, its outputs' slots, its write, its generator
// states and the grad mode.
bool commit_recipe(Commit& c) {
  const OpCall& call = c.call;
  const Scan& s = call.scratch.scan;
  const std::vector<long>& ins = call.scratch.ins;
  Entry* e = call.e;
  Ref rleaves(PyTuple_New(static_cast<Py_ssize_t>(s.leaves.size())));
  if (!rleaves) return false;
  size_t k = 0;
  for (size_t i = 0; i < s.leaves.size(); ++i) {
    PyObject* x = s.leaves[i].obj;
    if (s.leaves[i].tensor) {
      const at::Tensor& t = THPVariable_Unpack(x);
      PyObject* slot;
      if (call.written < 0) {  // (an op that writes nothing leaves its inputs' layouts as the signature's)
        slot = new_slot(ins[k], t, e->lay_size[k].get(), e->lay_stride[k].get(),
                        e->lay_dtype[k].get());
      } else {  // (layouts as they are now, as the reference reads them after an op that writes)
        Ref size(e->out_layout_or(e->lay_size[k].get(), t.sizes())), stride(e->out_layout_or(e->lay_stride[k].get(),
                                                                                              t.strides()));
        PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
        slot = size && stride ? new_slot(ins[k], t, size.get(), stride.get(), dtype) : nullptr;
      }
      if (slot == nullptr) return false;
      PyTuple_SET_ITEM(rleaves.get(), i, slot);
      ++k;
    } else {
      Py_INCREF(x);
      PyTuple_SET_ITEM(rleaves.get(), i, x);
    }
  }
  PyTypeObject* rt = reinterpret_cast<PyTypeObject*>(env.recipe_type);
  PyObject* recipe = rt->tp_alloc(rt, 8);
  if (recipe == nullptr) return false;
  Ref rec(recipe);
  Ref empty(PyTuple_New(0));
  if (!empty) return false;
  Py_INCREF(call.func); PyTuple_SET_ITEM(recipe, 0, call.func);
  PyTuple_SET_ITEM(recipe, 1, rleaves.release());
  Py_INCREF(e->spec.get()); PyTuple_SET_ITEM(recipe, 2, e->spec.get());
  PyTuple_SET_ITEM(recipe, 3, c.out_slots.release());
  if (call.written >= 0) {  // ((leaf position, old version, new version or -1 for a constant),)
    Ref w(Py_BuildValue("((iii))", 0, static_cast<int>(call.written), static_cast<int>(c.new_version)));
    if (!w) return false;
    untrack(w.get());
    untrack(PyTuple_GET_ITEM(w.get(), 0));
    empty = std::move(w);
  }
  PyTuple_SET_ITEM(recipe, 4, empty.release());
  PyObject* rng = call.rng.get();
  Py_INCREF(rng); PyTuple_SET_ITEM(recipe, 5, rng);
  PyObject* grad = at::GradMode::is_enabled() ? Py_True : Py_False;  // (Note [What a recomputation restores])
  Py_INCREF(grad); PyTuple_SET_ITEM(recipe, 6, grad);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(c10::get_default_dtype_as_scalartype()));
  Py_INCREF(dtype); PyTuple_SET_ITEM(recipe, 7, dtype);  // (the same Note: the default dtype)
  untrack(recipe);  // (and its leaves and outputs: see Note [Untracked records] in py_object.h)
  untrack(PyTuple_GET_ITEM(recipe, 1));
  untrack(PyTuple_GET_ITEM(recipe, 3));
  Ref opk(cached_int(call.op));
  return opk && PyDict_SetItem(recipes_of(call.f), opk.get(), recipe) == 0;
}

// The new version's place in its version chain (StorageTable.write's count of versions), and the chain
// pinned once it is limits.MAX_VERSIONS long (reference.py's Note [Version chains]).
bool commit_pin_version_chain(Commit& c) {
  FastPath* f = c.call.f;
  PyObject* versions = tget(f, T::versions);
  Ref old_k(cached_int(c.call.written)), new_k(cached_int(c.new_version));
  if (!old_k || !new_k) return false;
  Ref prev(PyObject_CallMethod(versions, "pop", "OO", old_k.get(), Py_False));
  if (!prev) return false;
  long n = PyLong_AsLong(prev.get()) + 1;
  Ref nk(PyLong_FromLong(n));
  if (!nk || PyDict_SetItem(versions, new_k.get(), nk.get()) < 0) return false;
  if (n < env.max_versions) return true;
  if (c.recorder != nullptr && c.recorder != Py_None) {
    PyObject* h = PyDict_GetItemWithError(c.handle, new_k.get());
    if (h == nullptr) return false;
    Ref r(PyObject_CallMethodOneArg(c.recorder, names.pin, h));
    if (!r) return false;
  }
  Ref why(PyLong_FromLong(3));  // dtr._C.Hold.VERSION_CHAIN (csrc/core.h): why it is pinned
  Ref r(why ? PyObject_CallMethodObjArgs(f->core, names.pin, new_k.get(), why.get(), nullptr) : nullptr);
  return static_cast<bool>(r);
}

// While any storage is volatile (driver.py's Note [Bytes written outside PyTorch]): the op's results pinned if it
// read one, by the reference's own ReferencePath._pin_if_volatile.
bool commit_pin_volatile(Commit& c) {
  const std::vector<long>& ins = c.call.scratch.ins;
  const std::vector<long>& outs = c.call.scratch.new_tensors;
  Ref a(PyList_New(0)), r(PyList_New(0));
  if (!a || !r) return false;
  for (long t : ins) {
    Ref k(cached_int(t));
    if (!k || PyList_Append(a.get(), k.get()) < 0) return false;
  }
  for (long t : outs) {
    Ref k(cached_int(t));
    if (!k || PyList_Append(r.get(), k.get()) < 0) return false;
  }
  if (c.new_version >= 0) {
    Ref k(cached_int(c.new_version));
    if (!k || PyList_Append(r.get(), k.get()) < 0) return false;
  }
  Ref done(PyObject_CallMethodObjArgs(c.call.f->mode, names._pin_if_volatile, a.get(), r.get(), nullptr));
  return static_cast<bool>(done);
}

}  // namespace

// Twin of ReferencePath._commit (dtr/runtime/reference.py): everything after the op ran, for an op that writes nothing
// or writes its first argument in place (call.written). ``out`` is the op's result (None through the
// dispatch key, whose outputs are on the stack): a new reference to it, or null with a Python exception set.
PyObject* mode_commit(OpCall& call, PyObject* out) {
  FastPath* f = call.f;
  Entry* e = call.e;
  Ref out_ref = borrowed(out);
  Commit c{call, call.to_constant ? -1 : call.written, tget(f, T::handle)};
  if (!commit_register_outputs(c) || !commit_write_version(c)) return nullptr;
  // computed from its inputs: see Note [Constants held weakly] in storage_table.py
  if ((!e->owning.empty() || c.new_written >= 0) && !table_computed_from(f, call.scratch.ins)) return nullptr;
  c.recorder = mget(f, S::recorder);
  if (c.recorder != nullptr && c.recorder != Py_None && !commit_record(c)) return nullptr;
  if (api->end_call(f->c, call.op, call.cost) < 0) { translate_error(); return nullptr; }
  PyObject* volatile_ = mget(f, S::_volatile);
  if (volatile_ != nullptr && PySet_Check(volatile_) && PySet_GET_SIZE(volatile_) > 0 && !commit_pin_volatile(c))
    return nullptr;
  if (!commit_saw(c)) return nullptr;
  // The recipe (ops that produce nothing are never recomputed).
  if ((!e->owning.empty() || call.written >= 0) && !commit_recipe(c)) return nullptr;
  if (c.new_written >= 0 && !commit_pin_version_chain(c)) return nullptr;
  if (call.ops_seen - mget_long(f, S::_ops_at_gc) > std::max(env.gc_min_ops, mget_long(f, S::_live_after_gc))) {
    Ref r(PyObject_CallMethodNoArgs(f->mode, names.collect));
    if (!r) return nullptr;
  }
  return out_ref.release();
}

}  // namespace dtr::native
