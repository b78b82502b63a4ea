// dtr._native: the runtime's per-op path in C++, built against torch. This file holds its two entries (the
// mode's __torch_dispatch__ and the dispatch key) and the reference's fallback; fastpath.h says which unit
// holds the rest.
//
// Note [The native per-op path]
// ReferencePath._dispatch (dtr/runtime/reference.py), through an entry (entry.py) is the reference: every
// rule of the runtime is written there, in Python. This module runs the
// common op through the same steps without the interpreter: an op whose
// tensor arguments are all strided tensors on the budget's device, that
// either writes nothing (by its schema or a hidden-write rule) or writes only
// its first argument in place (add_, mul_, ...: mode._native_op_info says
// which ops may), a storage dtr tracks that is not a constant (or a weakly
// held one whose protection pins nothing), whose output sizes the meta run
// predicted, and whose cost is known at once (the CPU's wall clock, or the
// flop model). It reads and writes the *same* state the reference keeps (the
// storage table's maps and Buf records, the recipes), in the same order, and
// calls the core through the same bound methods, so the two paths can be
// interleaved op by op and make the same decisions; tests/native/test_native.py runs
// the runtime's tests on both and compares recorded logs line by line.
// Anything else (first sight of a signature, other writes, factories,
// escapes, other layouts, CUDA event timing, full polls that find a dead
// constant, partial polls whose dead constants need more than settle_constants
// (liveness.cpp) does, collection, recomputation and eviction, which run from
// the core's hooks) is the reference's own code, called from here. The core
// (dtr._C) stays torch-free: this module reaches it only through the C table
// dtr._C exports for it (csrc/core_api.h, Note [The core's C route]).
//
// What is cached here, and why it cannot go stale:
//  * per op overload: whether it may take this path (no writes and not set_,
//    or an in-place write to its first argument), whether it is random, and its
//    log name. Cleared when a hidden-write rule is registered
//    (effects._generation changes).
//  * per signature (op, the structure of its arguments, every tensor's shape,
//    strides and dtype, every other argument's value): the reference's
//    prediction (output sizes, positions), its flatten spec, the layouts its
//    recipes record, and the flop estimate. All are functions of the
//    signature. Process-wide, bounded like the reference's cache.
//  * Python ints below 65536 (cached_int: core ids and the mode's counters);
//    ints are immutable, so nothing here can go stale.
#include "fastpath.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <exception>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace dtr::native {
namespace {

// Note [A new tensor for detach and alias]
// torch's _make_subclass (nn.Parameter, FakeTensor) and as_subclass give the result of their detach or alias
// a new Python object, and refuse a tensor that has one ("already associated to a python object"). torch
// spares a mode's handler those two ops (it takes every mode off the stack around them); the key cannot
// tell, and the reference's result has the Python object it was made with. So a detach or alias that went
// to the reference returns a shallow copy of its result: the same storage, sizes, strides and offset, with
// no Python object (nn.Parameter of a torch.from_numpy tensor, or of a sparse, quantized or nested one,
// raised in a block). dtr tracks storages, not tensor objects, and autograd's view of the result is made
// above the key from whatever is returned. Ops on meta tensors never get here (Note [Ops on meta tensors]).
bool gives_new_tensor(const c10::OperatorHandle& op) {
  static const c10::OperatorName detach("aten::detach", ""), alias("aten::alias", "");
  const c10::OperatorName& name = op.operator_name();
  return name == detach || name == alias;
}

// The reference's result in place of the op's arguments on the stack (what torch's Python fallback does).
void push_result(const KeyCall& kc, PyObject* r) {
  const auto& returns = kc.op->schema().returns();
  torch::jit::drop(*kc.stack, kc.n_args);
  if (returns.empty()) return;
  if (returns.size() == 1) {
    c10::IValue v = torch::jit::toIValue(r, returns[0].real_type());
    if (v.isTensor() && v.toTensor().defined() && gives_new_tensor(*kc.op)) {  // see the Note above
      const c10::TensorImpl* impl = v.toTensor().unsafeGetTensorImpl();
      v = at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change()));
    }
    kc.stack->push_back(std::move(v));
    return;
  }
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != static_cast<Py_ssize_t>(returns.size()))
    throw std::runtime_error("dtr internal error: the reference returned the wrong number of outputs");
  for (size_t i = 0; i < returns.size(); ++i)
    kc.stack->push_back(torch::jit::toIValue(PyTuple_GET_ITEM(r, i), returns[i].real_type()));
}

}  // namespace

// The reference takes the op: the entry's __torch_dispatch__ (dtr/runtime/entry.py) (f->fallback), and through the dispatch key (kc) its
// result replaces the op's arguments on the stack. Its result, or null with a Python exception set.
PyObject* run_fallback(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                       const KeyCall* kc) {
  f->fallback_ops++;
  PyObject* a[5] = {f->mode, func, types, args, kwargs ? kwargs : Py_None};
  PyObject* r = PyObject_Vectorcall(f->fallback, a, 5, nullptr);
  if (r != nullptr && kc != nullptr) {
    try {
      push_result(*kc, r);
    } catch (...) {
      Py_DECREF(r);
      throw;
    }
  }
  return r;
}

// Twin of ReferencePath._dispatch (dtr/runtime/reference.py), through an entry (entry.py): mode_dispatch, naming the op in a budget error
// that leaves it (dtr/runtime/failures.py: the core reports ids). Both entries run it: the mode's through
// FastPath's call (module.cpp), the dispatch key's through key_entry.
PyObject* mode_torch_dispatch(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                              const KeyCall* kc) {
  PyObject* r = mode_dispatch(f, func, types, args, kwargs, kc);
  if (r == nullptr && PyErr_Occurred() && env.name_failure != nullptr) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != nullptr && v != nullptr) PyException_SetTraceback(v, tb);
    PyObject* named = v ? PyObject_CallFunctionObjArgs(env.name_failure, f->mode, v, func, nullptr) : nullptr;
    if (named == nullptr) PyErr_Clear();  // (the error itself is the one the program sees)
    Py_XDECREF(named);
    PyErr_Restore(t, v, tb);
  }
  return r;
}

// ------------------------------------------------------------ the dispatch key
// Note [The dispatch-key entry]
// A TorchDispatchMode costs every op a round trip into Python and back: its
// arguments and results converted twice, the mode's __torch_dispatch__ looked
// up and called, the op's Python object called. On the TreeLSTM that alone
// costs about 1.3x plain PyTorch (benchmarks/bench_dispatch_floor.py), more
// than the issue allows dtr in all. The entry instead puts a C++ boxed
// fallback on a dispatch key below autograd and includes that key in the
// thread's dispatch key set while the block runs (ThreadLocalState carries it
// to the autograd engine's threads, as it carries the mode stack): every op
// autograd passes down arrives at `key_entry` with its arguments on the
// stack. It converts the arguments to Python (cheap: the tensors mostly have
// their Python objects already) and runs the same steps as the mode's entry
// (mode_torch_dispatch), except that the op itself runs on the original stack
// below the key (mode_execute) and its outputs are read from there, never
// converted back.
// Whatever the native steps do not take goes to the reference's
// __torch_dispatch__, whose result replaces the arguments on the stack.
//
// The key is `Fake`, which torch 2.13 reserves for a C++ FakeTensor mode and
// registers nothing for; the fallback is registered on the first block that
// asks for this entry, and a failure to register is an error the block
// reports (dtr then uses the mode's entry). While dtr's own work runs (the
// op, recomputations, the reference), every key from this one up is
// excluded, as torch excludes every key above Python while a mode's handler
// runs: nothing dtr runs is seen again or recorded by autograd.
//
// What differs from a mode: the op stream. Without Python objects holding
// extra references, autograd accumulates gradients in place (add_ where a
// mode sees add) and shallow copies do not dispatch detach. So the
// differential tests compare this entry's native steps against this entry's
// reference (key_reference: every op to the reference), which see the same
// stream. User modes (Python key, above this one) see ops before dtr.
namespace {

FastPath* key_owner = nullptr;  // the block that owns the key, owned (one at a time: the key's state is process-wide)
bool key_registered = false;

PyObject* python_op(const c10::OperatorHandle& op) {  // torch.ops.<ns>.<name>.<overload>, cached, borrowed
  static auto& ops = *new std::unordered_map<const c10::FunctionSchema*, Ref>();
  const c10::FunctionSchema& schema = op.schema();
  auto it = ops.find(&schema);
  if (it != ops.end()) return it->second.get();
  const std::string& full = schema.name();
  auto sep = full.find("::");
  std::string ns = full.substr(0, sep), name = full.substr(sep + 2);
  std::string overload = schema.overload_name().empty() ? "default" : schema.overload_name();
  Ref torch_mod(PyImport_ImportModule("torch"));
  Ref o(torch_mod ? PyObject_GetAttrString(torch_mod.get(), "ops") : nullptr);
  for (const std::string* part : {&ns, &name, &overload}) {
    if (!o) return nullptr;
    o = Ref(PyObject_GetAttrString(o.get(), part->c_str()));
  }
  if (!o) return nullptr;
  PyObject* r = o.get();
  ops.emplace(&schema, std::move(o));
  return r;
}

// One argument as a mode's handler receives it (torch passes dtypes, layouts and memory formats as their objects).
PyObject* argument_to_python(const c10::Argument& arg, const c10::IValue& v) {
  if (v.isNone()) Py_RETURN_NONE;
  c10::TypePtr t = arg.real_type();
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  switch (t->kind()) {
    case c10::TypeKind::ScalarTypeType: {
      PyObject* o = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt())));
      Py_INCREF(o);
      return o;
    }
    case c10::TypeKind::LayoutType: {
      PyObject* o = reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt())));
      Py_INCREF(o);
      return o;
    }
    case c10::TypeKind::MemoryFormatType: {
      PyObject* o = torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt()));
      Py_XINCREF(o);
      return o;
    }
    default:
      return torch::jit::toPyObject(v).release().ptr();
  }
}

// Note [Ops on meta tensors]
// An op whose tensor arguments are all on the meta device (or a factory told to allocate there) touches no
// memory: the reference runs it and tracks nothing (storage_table.trackable refuses meta tensors). Through
// the key it still cost a round trip to Python, and worse, the reference's result came back as a tensor that
// already had a Python object. torch's _make_subclass and as_subclass, which give the tensor their own
// detach or alias returns a new Python object, then refused it ("already associated to a python object"):
// nn.Parameter of a meta tensor (nn.Linear(..., device="meta")), FakeTensorMode and make_fx failed in a
// block. torch spares a mode's handler those two ops by taking every mode off the stack around them; the key
// cannot tell, so such an op passes the key in C++, as it passes a block that owns no key.
bool meta_only(c10::ArrayRef<c10::IValue> in) {
  bool meta = false;
  auto tensor_is_meta = [&meta](const at::Tensor& t) {
    if (!t.defined()) return true;
    meta = true;
    return t.is_meta();
  };
  for (const c10::IValue& v : in) {
    if (v.isTensor()) {
      if (!tensor_is_meta(v.toTensor())) return false;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec())
        if (!tensor_is_meta(t)) return false;
    } else if (v.isList()) {
      for (const c10::IValue& x : v.toListRef())
        if (x.isTensor() && !tensor_is_meta(x.toTensor())) return false;
    } else if (v.isDevice()) {
      if (v.toDevice().type() != c10::DeviceType::Meta) return false;
      meta = true;
    }
  }
  return meta;
}

void key_entry(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // dtr's own work and the op's are below this key and outside autograd (see the Note above)
  c10::impl::ExcludeDispatchKeyGuard off(c10::DispatchKeySet(c10::DispatchKeySet::FULL) ^
                                         c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kEntryKey));
  pybind11::gil_scoped_acquire gil;
  FastPath* f = key_owner;
  const auto& schema_args = op.schema().arguments();
  size_t n = schema_args.size();
  auto in = torch::jit::last(*stack, n);
  if (f == nullptr || meta_only(in)) {  // (no block owns the key, or no memory: pass the op on)
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kEntryKey), stack);
    return;
  }
  size_t n_pos = 0;
  for (const auto& a : schema_args) n_pos += !a.kwarg_only();
  PyObject* func = python_op(op);
  Ref args(func ? PyTuple_New(static_cast<Py_ssize_t>(n_pos)) : nullptr), kwargs;
  Py_ssize_t pos = 0;
  for (size_t i = 0; args && i < n; ++i) {
    PyObject* o = argument_to_python(schema_args[i], in[i]);
    if (o == nullptr) { args = Ref(); break; }
    if (!schema_args[i].kwarg_only() && pos < static_cast<Py_ssize_t>(n_pos)) {
      PyTuple_SET_ITEM(args.get(), pos++, o);
      continue;
    }
    Ref ov(o);
    if (!kwargs) kwargs = Ref(PyDict_New());
    if (!kwargs || PyDict_SetItemString(kwargs.get(), schema_args[i].name().c_str(), o) < 0) { args = Ref(); break; }
  }
  PyObject* r = nullptr;
  if (args) {
    Ref types(PyTuple_New(0));
    KeyCall kc{&op, ks, stack, n};
    if (types)  // (C++ errors pass through)
      r = mode_torch_dispatch(f, func, types.get(), args.get(), kwargs.get(), &kc);
  }
  if (r == nullptr) {
    python_error err;
    err.persist();
    throw err;
  }
  Py_DECREF(r);
}

bool register_key_entry() {
  if (key_registered) return true;
  try {
    static torch::Library* lib = new torch::Library(torch::Library::IMPL, "_", kEntryKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&key_entry>());
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "dtr: cannot take the %s dispatch key for the native entry: %s",
                 c10::toString(kEntryKey), e.what());
    return false;
  }
  key_registered = true;
  return true;
}

}  // namespace

// key_enter(fastpath, reference): the block's ops come through the dispatch key (Note [The dispatch-key entry]).
PyObject* key_enter(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2 || !PyObject_TypeCheck(args[0], &FastPathType)) {
    PyErr_SetString(PyExc_TypeError, "key_enter(fastpath, reference)");
    return nullptr;
  }
  if (key_owner != nullptr) Py_RETURN_FALSE;  // another block owns it: that one uses the mode's entry
  if (!register_key_entry()) return nullptr;
  FastPath* f = reinterpret_cast<FastPath*>(args[0]);
  f->key_reference = PyObject_IsTrue(args[1]) == 1;
  Py_INCREF(args[0]);
  key_owner = f;
  c10::impl::tls_set_dispatch_key_included(kEntryKey, true);
  Py_RETURN_TRUE;
}

PyObject* key_exit(PyObject*, PyObject*) {
  c10::impl::tls_set_dispatch_key_included(kEntryKey, false);
  FastPath* f = key_owner;
  key_owner = nullptr;
  Py_XDECREF(reinterpret_cast<PyObject*>(f));
  Py_RETURN_NONE;
}

// key_exclude(flag) -> the previous flag: whether this thread's ops skip the key (dtr's own work outside an op).
PyObject* key_exclude(PyObject*, PyObject* flag) {
  bool prev = c10::impl::tls_is_dispatch_key_excluded(kEntryKey);
  c10::impl::tls_set_dispatch_key_excluded(kEntryKey, PyObject_IsTrue(flag) == 1);
  return PyBool_FromLong(prev);
}

// Whether this thread's ops go to the block's entry now (not while dtr's own work runs: see the Note).
PyObject* key_active(PyObject*, PyObject*) {
  return PyBool_FromLong(key_owner != nullptr && c10::impl::tls_is_dispatch_key_included(kEntryKey) &&
                         !c10::impl::tls_is_dispatch_key_excluded(kEntryKey));
}

}  // namespace dtr::native
