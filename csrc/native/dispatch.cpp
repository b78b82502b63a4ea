// dispatch.cpp - the per-op steps up to and including the op (ReferencePath._dispatch and _execute in
// dtr/runtime/reference.py) on the native per-op path: mode_dispatch, as named steps in the reference's order. What
// runs after the op is mode_commit (commit.cpp); what this path does not take goes to the reference
// (run_fallback, fastpath.cpp).
#include "fastpath.h"

#include "depth_pool.h"

#include <torch/csrc/autograd/python_variable.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>
#include <exception>
#include <string>
#include <vector>

namespace dtr::native {
namespace {

// The leaf of x that Driver._trackable meets first (a strided tensor, neither nested, meta, zero nor
// quantized, nor a wrapper subclass: storage_table.trackable): 1 with *first
// set, 0 if there is none; -1 if x holds a dict (whose leaves this scan does not order as the reference does).
int first_trackable(PyObject* x, PyObject** first) {
  if (PyTuple_Check(x) || PyList_Check(x)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
    PyObject** items = PySequence_Fast_ITEMS(x);
    for (Py_ssize_t i = 0; i < n; ++i) {
      int r = first_trackable(items[i], first);
      if (r != 0) return r;
    }
    return 0;
  }
  if (PyDict_Check(x)) return -1;
  if (THPVariable_Check(x)) {
    const at::Tensor& t = THPVariable_Unpack(x);
    if (t.defined() && t.layout() == c10::kStrided && !t.is_nested() && !t.is_meta() && !t.is_quantized() &&
        !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::ZeroTensor}))) {
      *first = x;
      return 1;
    }
  }
  return 0;
}

// The block's first op with a trackable tensor sets the device (Driver._set_device, as the reference's
// _trackable does), so that it runs here too. False with an error set if that failed.
bool set_device_from(FastPath* f, PyObject* args, PyObject* kwargs) {
  PyObject* first = nullptr;
  int r = first_trackable(args, &first);
  if (r == 0 && kwargs != nullptr) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (r == 0 && PyDict_Next(kwargs, &pos, &k, &v)) r = first_trackable(v, &first);
  }
  if (r <= 0) return true;  // (none, or not sure: the reference decides)
  Ref device(PyObject_GetAttr(first, names.device));
  Ref done(device ? PyObject_CallMethodOneArg(f->mode, names._set_device, device.get()) : nullptr);
  return static_cast<bool>(done);
}

void flatten_out(PyObject* x, std::vector<PyObject*>& out) {  // mode.tree_flatten of a result
  if (PyTuple_Check(x) || PyList_Check(x)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
    PyObject** items = PySequence_Fast_ITEMS(x);
    for (Py_ssize_t i = 0; i < n; ++i) flatten_out(items[i], out);
    return;
  }
  out.push_back(x);
}

// Whether this op may take the path at all, from what the block and the op are: 1 with *info set, 0 for the
// reference, -1 on error. Nothing here changes the block's state, except that its first op with a trackable
// tensor sets the device (set_device_from).
int dispatch_admit(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                   const KeyCall* kc, const OpInfo** info) {
  if (PyTuple_Check(types)) {  // a tensor subclass's op: the reference declines it (reference.py's Note [Tensor
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); ++i)  // subclasses]; torch.Tensor itself may be named)
      if (PyTuple_GET_ITEM(types, i) != THPVariableClass) return 0;
  }
  PyObject* device_type = mget(f, S::device_type);
  if (device_type == Py_None && PyTuple_Check(args)) {
    if (!set_device_from(f, args, kwargs)) return -1;
    device_type = mget(f, S::device_type);
  }
  PyObject* opaque = mget(f, S::_opaque_readers);
  PyObject* timer = mget(f, S::timer);
  if (device_type == nullptr || device_type == Py_None || !PyUnicode_Check(device_type) ||
      (opaque != nullptr && PyDict_Check(opaque) && PyDict_GET_SIZE(opaque) > 0) || timer == nullptr ||
      (f->measured && reinterpret_cast<PyObject*>(Py_TYPE(timer)) != env.wall_timer) || !PyTuple_Check(args))
    return PyErr_Occurred() ? -1 : 0;
  if (device_type != f->device_name) {
    const char* name = PyUnicode_AsUTF8(device_type);
    if (name == nullptr) return -1;
    try {
      f->device = c10::Device(std::string(name)).type();
    } catch (const std::exception&) {
      return 0;
    }
    Py_INCREF(device_type);
    Py_XSETREF(f->device_name, device_type);
  }
  *info = op_info(func);
  if (*info == nullptr) return -1;
  if ((!(*info)->fast && !(*info)->inplace) || (kc != nullptr && f->key_reference)) return 0;
  return 1;
}

// The op's signature and its entry (what the reference predicted), and for an in-place op the version it
// writes (its first argument's): 1 if this path takes the op, 0 for the reference, -1 on error.
int dispatch_predict(OpCall& call, PyObject* args, PyObject* kwargs) {
  Scan& s = call.scratch.scan;
  s.device = call.f->device;
  if (!scan_args(call.func, args, kwargs, s) || s.tpos.empty()) return PyErr_Occurred() ? -1 : 0;
  call.e = prediction_of_op(call.f, call.func, args, kwargs, s);
  if (call.e == nullptr) return -1;
  if (!call.e->ok) return 0;
  if (call.info->inplace) {
    if (!call.e->sizes.empty() || s.tpos[0] != 0 || !s.leaves[0].tensor) return 0;
    int w = written_version(call.f, s.leaves[0].obj, &call.written);
    if (w <= 0) return w;
    call.to_constant = w == 2;
  }
  return 1;
}

// The op is counted (the mode's ops_seen) and its tensor inputs tracked (Driver._track: a constant on first
// sight), into scratch.ins. False with a Python exception set on error.
bool dispatch_track(OpCall& call) {
  FastPath* f = call.f;
  call.ops_seen = mget_long(f, S::ops_seen) + 1;
  if (call.ops_seen <= 0 || !mset_long(f, S::ops_seen, call.ops_seen)) return false;
  const Scan& s = call.scratch.scan;
  std::vector<long>& ins = call.scratch.ins;
  for (int p : s.tpos) {
    long t = mode_track(f, s.leaves[p].obj);
    if (t < 0) return false;
    ins.push_back(t);
  }
  return true;
}

// The storages the program dropped are released (Driver.poll): every live one when the scheduled full poll
// is due, the op would exceed the budget, or an input must be recomputed (which must not read a storage just
// dropped); else those of the last ops. False with a Python exception set on error.
bool dispatch_poll(OpCall& call) {
  FastPath* f = call.f;
  int64_t need = api->memory(f->c) + call.e->total;
  int64_t budget = api->budget(f->c);
  bool full = liveness_due(f, call.ops_seen, need) || (budget >= 0 && need > budget);
  if (!full) {
    for (long t : call.scratch.ins) {  // a recomputation must not read a storage just dropped
      int d = api->defined(f->c, static_cast<int>(t));
      if (d < 0) return false;
      if (!d) { full = true; break; }
    }
  }
  if (full) {
    if (!liveness_poll_full(f, call.scratch)) return false;
  } else {
    PyObject* recent = lget(f, L::recent);
    if (PyList_GET_SIZE(recent) > 0 && !liveness_poll_recent(f, recent, call.scratch)) return false;
  }
  return !PyErr_Occurred();
}

// Note [Writes that protecting pins] (dtr/runtime/reference.py): the poll may have pinned the version this op
// writes (a constant it was computed from was dropped, and protected). Its write is then a write to a constant
// (no new version), protected first (ReferencePath._protect_written). False with a Python exception set on error.
bool dispatch_recheck_write(OpCall& call) {
  if (call.written < 0 || call.to_constant) return true;
  FastPath* f = call.f;
  int st = storage_of(f, call.written);
  if (st < 0) return false;
  int pinned = api->pinned(f->c, st);
  if (pinned <= 0) return pinned == 0;
  Ref key(cached_int(st));
  Ref r(key ? PyObject_CallMethodOneArg(f->mode, names._protect_written, key.get()) : nullptr);
  if (!r) return false;
  call.to_constant = true;
  return true;
}

// The generator states a random op's recipe replays (recompute.rng_capture), into call.rng; else None.
// False with a Python exception set on error.
bool dispatch_rng(OpCall& call) {
  call.rng = borrowed(Py_None);
  if (!call.info->seeded) return true;
  const Scan& s = call.scratch.scan;
  Ref leaves(PyList_New(static_cast<Py_ssize_t>(s.leaves.size())));
  if (!leaves) return false;
  for (size_t i = 0; i < s.leaves.size(); ++i) {
    Py_INCREF(s.leaves[i].obj);
    PyList_SET_ITEM(leaves.get(), i, s.leaves[i].obj);
  }
  Ref device(PyObject_GetAttr(s.leaves[s.tpos[0]].obj, names.device));
  if (!device) return false;
  PyObject* a[3] = {call.func, leaves.get(), device.get()};
  call.rng = Ref(PyObject_Vectorcall(env.rng_capture, a, 3, nullptr));
  return static_cast<bool>(call.rng);
}

// The core's op begins (it brings the inputs back, locks them and makes room), into call.op, at the op's
// estimated cost (the flop model's; with measured costs, the op's time once it ran). False with a Python
// exception set on error.
bool dispatch_begin(OpCall& call, PyObject* args, PyObject* kwargs) {
  FastPath* f = call.f;
  Entry* e = call.e;
  const std::vector<long>& ins = call.scratch.ins;
  double cost = 0.0;  // a view computes nothing
  if (!f->measured && (!e->sizes.empty() || call.written >= 0)) {
    if (!entry_flops(f, e, call.func, args, kwargs)) return false;
    cost = e->flops;
  }
  call.cost = cost;
  std::vector<int>& in_ids = call.scratch.in_ids;
  in_ids.assign(ins.begin(), ins.end());
  int op;
  if (call.written < 0 || call.to_constant) {  // (a write to a constant makes no new version: reference.py's const_writes)
    op = api->begin_call(f->c, in_ids.data(), static_cast<int>(in_ids.size()), e->sizes.data(),
                         static_cast<int>(e->sizes.size()), cost);
  } else {  // the new version of the written input last, sized as its storage (reference.py: inplace_of)
    if (ins[0] != call.written) {
      PyErr_SetString(PyExc_RuntimeError, "dtr internal error: a written version changed as it was tracked");
      return false;
    }
    int st = storage_of(f, call.written);
    int64_t size = st < 0 ? -1 : api->storage_size(f->c, st);
    if (size < 0) return false;
    std::vector<int64_t>& all_sizes = call.scratch.all_sizes;
    std::vector<int>& inplace_of = call.scratch.inplace_of;
    all_sizes.assign(e->sizes.begin(), e->sizes.end());
    all_sizes.push_back(size);
    inplace_of.assign(e->sizes.size(), -1);
    inplace_of.push_back(0);  // (ins.index(written): the first argument is the first tensor)
    op = api->begin_call_inplace(f->c, in_ids.data(), static_cast<int>(in_ids.size()), all_sizes.data(),
                                 inplace_of.data(), static_cast<int>(all_sizes.size()), cost);
  }
  if (op < 0) { translate_error(); return false; }
  call.op = op;
  return true;
}

// Twin of ReferencePath._execute (dtr/runtime/reference.py): the op itself, timed on the host clock (timing.WallTimer:
// perf_counter_ns) when costs are measured (call.cost). Through the dispatch key (kc), the op's own arguments
// run below the key and its outputs are read from the stack into scratch.touts (Note [The dispatch-key
// entry] in fastpath.cpp); else its operator is called here and its result flattened into scratch.flat. Its
// result (None through the key), a new reference; if the op fails, null with its error set (or its C++
// exception passed on), the core's op aborted.
PyObject* mode_execute(OpCall& call, PyObject* args, PyObject* kwargs, const KeyCall* kc) {
  FastPath* f = call.f;
  auto t0 = std::chrono::steady_clock::now();
  PyObject* out;
  if (kc != nullptr) {
    std::vector<at::Tensor>& touts = call.scratch.touts;
    try {
      kc->op->redispatchBoxed(kc->ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kEntryKey), kc->stack);
    } catch (...) {
      if (api->abort_call(f->c, call.op) < 0) PyErr_Clear();  // (the op's own error is the one the program sees)
      throw;
    }
    size_t n_ret = kc->op->schema().returns().size();
    for (size_t i = kc->stack->size() - n_ret; i < kc->stack->size(); ++i) {
      const c10::IValue& v = (*kc->stack)[i];
      if (v.isTensor()) {
        touts.push_back(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& x : v.toTensorList().vec()) touts.push_back(x);
      } else if (v.isList()) {  // (Tensor?[]: a leaf per element, as the reference flattens it)
        for (const c10::IValue& x : v.toListRef()) touts.push_back(x.isTensor() ? x.toTensor() : at::Tensor());
      } else {
        touts.emplace_back();
      }
    }
    call.scratch.outs_on_stack = true;
    Py_INCREF(Py_None);
    out = Py_None;
  } else {
    out = PyObject_Call(call.info->call.get(), args, kwargs);
    if (out == nullptr) {
      PyObject *et, *ev, *etb;
      PyErr_Fetch(&et, &ev, &etb);
      if (api->abort_call(f->c, call.op) < 0) PyErr_Clear();  // (the op's own error is the one the program sees)
      PyErr_Restore(et, ev, etb);
      return nullptr;
    }
    flatten_out(out, call.scratch.flat);
  }
  auto t1 = std::chrono::steady_clock::now();
  if (f->measured)
    call.cost = static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
  return out;
}

}  // namespace

// Twin of ReferencePath._dispatch (dtr/runtime/reference.py): the reference per-op path without naming budget errors
// (mode_torch_dispatch names them), step by step. kc: where the op is on the stack when it came through the
// dispatch key (Note [The dispatch-key entry] in fastpath.cpp), else null. What this path does not take goes
// to the reference. The op's result (None through the key), or null with a Python exception set.
PyObject* mode_dispatch(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                        const KeyCall* kc) {
  if (kwargs == Py_None || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) == 0)) kwargs = nullptr;
  const OpInfo* info = nullptr;
  int admitted = dispatch_admit(f, func, types, args, kwargs, kc, &info);
  if (admitted <= 0) return admitted < 0 ? nullptr : run_fallback(f, func, types, args, kwargs, kc);
  dtr::DepthLease<Scratch> lease;
  Scratch& scratch = *lease;
  scratch.clear();
  OpCall call{f, func, info, scratch};
  int predicted = dispatch_predict(call, args, kwargs);
  if (predicted <= 0) return predicted < 0 ? nullptr : run_fallback(f, func, types, args, kwargs, kc);
  f->native_ops++;

  // From here on, the reference's _dispatch step by step.
  if (!dispatch_track(call) || !dispatch_poll(call) || !dispatch_recheck_write(call) || !dispatch_rng(call) ||
      !dispatch_begin(call, args, kwargs))
    return nullptr;
  struct Release {  // (the scratch outlives the op: holding its outputs would keep them alive)
    std::vector<at::Tensor>& v;
    ~Release() { v.clear(); }
  } release_outputs{scratch.touts};
  PyObject* out = mode_execute(call, args, kwargs, kc);
  if (out == nullptr) return nullptr;
  PyObject* result = mode_commit(call, out);
  Py_DECREF(out);
  return result;
}

}  // namespace dtr::native
