// prediction.cpp - what this path knows of an op before it runs it (dtr/runtime/prediction.py): its
// signature (the op, the structure of its arguments, every tensor's shape, strides and dtype, every other
// argument's value), the reference's prediction per signature (PredictionCache, filled by
// ReferencePath._native_predict) with the layouts its recipes record and its flop estimate, and per op overload
// what mode._native_op_info says of it.
#include "fastpath.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace dtr::native {

// ------------------------------------------------------------------ signatures
namespace {

enum Tag : int64_t { kTuple = 1, kList, kTensor, kNone, kFalse, kTrue, kInt, kFloat, kStr, kSingleton, kDevice,
                     kKwargs, kKey };

void push_str(std::vector<int64_t>& key, PyObject* s) {
  Py_ssize_t n = 0;
  const char* c = PyUnicode_AsUTF8AndSize(s, &n);
  if (c == nullptr) { PyErr_Clear(); key.push_back(-1); return; }
  key.push_back(kStr);
  key.push_back(n);
  for (Py_ssize_t i = 0; i < n; i += 8) {
    int64_t w = 0;
    std::memcpy(&w, c + i, std::min<Py_ssize_t>(8, n - i));
    key.push_back(w);
  }
}

// False: a value this path does not take (the op goes to the reference).
bool scan_value(PyObject* x, Scan& s) {
  auto& key = s.key;
  if (PyTuple_Check(x) || PyList_Check(x)) {  // (subclasses too: the reference's isinstance)
    bool list = PyList_Check(x);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
    key.push_back(list ? kList : kTuple);
    key.push_back(n);
    PyObject** items = PySequence_Fast_ITEMS(x);
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!scan_value(items[i], s)) return false;
    return true;
  }
  // (Values that cannot be tensors first: THPVariable_Check of anything but a tensor is an isinstance call
  // that looks __instancecheck__ up on the tensor's metaclass, the dearest step of scanning an int.)
  bool tensor = THPVariable_CheckExact(x) ||
                (x != Py_None && x != Py_False && x != Py_True && !PyLong_CheckExact(x) && !PyFloat_CheckExact(x) &&
                 !PyUnicode_CheckExact(x) && THPVariable_Check(x));
  if (tensor) {
    const at::Tensor& t = THPVariable_Unpack(x);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || t.is_meta() || t.is_quantized() || !t.has_storage() ||
        !t.storage().resizable() ||  // (memory PyTorch does not own: driver.py's Note [Bytes written outside PyTorch])
        t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::ZeroTensor})) ||
        t.device().type() != s.device)
      return false;  // untracked tensors, and wrapper subclasses (reference.py's Note [Tensor subclasses]): the reference
    key.push_back(kTensor);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    int64_t d = t.dim();
    key.push_back(d);
    for (int64_t v : t.sizes()) key.push_back(v);
    for (int64_t v : t.strides()) key.push_back(v);
    s.tpos.push_back(static_cast<int>(s.leaves.size()));
    s.leaves.push_back({x, true});
    return true;
  }
  if (x == Py_None) {
    key.push_back(kNone);
  } else if (x == Py_False || x == Py_True) {
    key.push_back(x == Py_True ? kTrue : kFalse);
  } else if (PyLong_CheckExact(x)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow != 0) return false;
    key.push_back(kInt);
    key.push_back(v);
  } else if (PyFloat_CheckExact(x)) {
    double v = PyFloat_AS_DOUBLE(x);
    int64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    key.push_back(kFloat);
    key.push_back(bits);
  } else if (PyUnicode_CheckExact(x)) {
    push_str(key, x);
  } else if (THPDtype_Check(x) || THPLayout_Check(x) || THPMemoryFormat_Check(x)) {
    key.push_back(kSingleton);  // torch's own immortal singletons: identity is value
    key.push_back(reinterpret_cast<int64_t>(x));
  } else if (THPDevice_Check(x)) {
    const c10::Device& d = reinterpret_cast<THPDevice*>(x)->device;
    key.push_back(kDevice);
    key.push_back(static_cast<int64_t>(d.type()));
    key.push_back(d.index());
  } else {
    return false;  // generators, symbolic values, other objects: the reference's path
  }
  s.leaves.push_back({x, false});
  return true;
}

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

// (Never destroyed: their references must not be released after the interpreter is gone.)
auto& predictions = *new std::unordered_map<std::vector<int64_t>, Entry, KeyHash>();
auto& op_infos = *new std::unordered_map<PyObject*, OpInfo>();  // keys kept alive by op_keepalive
auto& op_keepalive = *new std::vector<Ref>();
long op_generation = -1;

}  // namespace

// The signature of func(*args, **kwargs) and its leaves, in the reference's order (mode.tree_flatten), into s.
// False: an argument this path does not take (the op goes to the reference).
bool scan_args(PyObject* func, PyObject* args, PyObject* kwargs, Scan& s) {
  s.key.push_back(kKey);
  s.key.push_back(reinterpret_cast<int64_t>(func));
  // (the default dtype: it decides the dtype of a factory without dtype= and of Python floats promoted)
  s.key.push_back(static_cast<int64_t>(c10::get_default_dtype_as_scalartype()));
  if (!scan_value(args, s)) return false;
  if (kwargs != nullptr) {
    s.key.push_back(kKwargs);
    s.key.push_back(PyDict_GET_SIZE(kwargs));
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(kwargs, &pos, &k, &v)) {
      if (!PyUnicode_Check(k)) return false;
      push_str(s.key, k);
      if (!scan_value(v, s)) return false;
    }
  }
  return true;
}

// ----------------------------------------------------------------- predictions
// A new reference to `cached` (a tuple of ints) if it holds v, else to a new tuple of v.
PyObject* Entry::out_layout_or(PyObject* cached, c10::IntArrayRef v) {
  if (cached != nullptr && PyTuple_Check(cached) && PyTuple_GET_SIZE(cached) == static_cast<Py_ssize_t>(v.size())) {
    bool same = true;
    for (size_t i = 0; same && i < v.size(); ++i)
      same = PyLong_AsLongLong(PyTuple_GET_ITEM(cached, static_cast<Py_ssize_t>(i))) == v[i];
    if (PyErr_Occurred()) return nullptr;
    if (same) {
      Py_INCREF(cached);
      return cached;
    }
  }
  return int_tuple(v);
}

// A new reference to a tuple of v for output k's shape (which 0) or stride (which 1).
PyObject* Entry::out_layout(size_t k, int which, c10::IntArrayRef v) {
  std::vector<Ref>& tuples = out_tuples[which];
  std::vector<std::vector<int64_t>>& values = out_values[which];
  if (tuples.size() <= k) {
    tuples.resize(k + 1);
    values.resize(k + 1);
  }
  if (tuples[k] && values[k].size() == v.size() && std::equal(v.begin(), v.end(), values[k].begin())) {
    Py_INCREF(tuples[k].get());
    return tuples[k].get();
  }
  PyObject* t = int_tuple(v);
  if (t == nullptr) return nullptr;
  tuples[k] = borrowed(t);
  values[k].assign(v.begin(), v.end());
  return t;
}

// Twin of PredictionCache.of_op (dtr/runtime/prediction.py): the signature's entry; on first sight, the
// reference predicts (ReferencePath._native_predict), and its answer is kept, bounded as the reference's cache.
Entry* prediction_of_op(FastPath* f, PyObject* func, PyObject* args, PyObject* kwargs, Scan& s) {
  auto it = predictions.find(s.key);
  if (it != predictions.end()) return &it->second;
  Ref kw = kwargs ? borrowed(kwargs) : Ref(PyDict_New());
  Ref r(kw ? PyObject_CallMethodObjArgs(f->mode, names._native_predict, func, args, kw.get(), nullptr) : nullptr);
  if (!r) return nullptr;
  PyObject *leaves, *spec, *layouts, *pred;
  if (!PyArg_ParseTuple(r.get(), "OOOO", &leaves, &spec, &layouts, &pred)) return nullptr;
  Entry e;
  e.func = borrowed(func);
  e.spec = borrowed(spec);
  Ref sizes(PyObject_GetAttr(pred, names.sizes)), owning(PyObject_GetAttr(pred, names.owning));
  e.metas = Ref(PyObject_GetAttr(pred, names.metas));
  if (!sizes || !owning || !e.metas) return nullptr;
  bool agree = PyList_Check(leaves) && PyList_GET_SIZE(leaves) == static_cast<Py_ssize_t>(s.leaves.size());
  for (size_t i = 0; agree && i < s.leaves.size(); ++i)
    agree = (PyList_GET_ITEM(leaves, i) == s.leaves[i].obj);
  if (agree && sizes.get() != Py_None) {
    Ref sz(PySequence_Fast(sizes.get(), "sizes")), ow(PySequence_Fast(owning.get(), "owning"));
    if (!sz || !ow) return nullptr;
    e.ok = PySequence_Fast_GET_SIZE(sz.get()) == PySequence_Fast_GET_SIZE(ow.get());  // (one size per owner)
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sz.get()); ++i) {
      e.sizes.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(sz.get(), i)));
      e.total += e.sizes.back();
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ow.get()); ++i)
      e.owning.push_back(static_cast<int>(PyLong_AsLong(PySequence_Fast_GET_ITEM(ow.get(), i))));
    for (int p : s.tpos) {  // layouts[p] = (shape, stride, dtype)
      PyObject* lay = PyTuple_GetItem(layouts, p);
      if (lay == nullptr || !PyTuple_Check(lay) || PyTuple_GET_SIZE(lay) != 3) return nullptr;
      e.lay_size.push_back(borrowed(PyTuple_GET_ITEM(lay, 0)));
      e.lay_stride.push_back(borrowed(PyTuple_GET_ITEM(lay, 1)));
      e.lay_dtype.push_back(borrowed(PyTuple_GET_ITEM(lay, 2)));
    }
    if (PyErr_Occurred()) return nullptr;
  }
  if (predictions.size() >= env.max_predictions) predictions.clear();  // (the reference's bound)
  return &predictions.emplace(s.key, std::move(e)).first->second;
}

// The signature's flop estimate (the cost model's ``estimate``), computed once per cost model (each has its
// own cache) into e->flops. False with a Python exception set on error.
bool entry_flops(FastPath* f, Entry* e, PyObject* func, PyObject* args, PyObject* kwargs) {
  if (!(e->flops < 0 || e->flops_model.get() != f->cost_model)) return true;  // (known)
  Ref kw = kwargs ? borrowed(kwargs) : Ref(PyDict_New());
  Ref r(kw ? PyObject_CallMethodObjArgs(f->cost_model, names.estimate, func, args, kw.get(), e->metas.get(), nullptr)
           : nullptr);
  if (!r) return false;
  e->flops = PyFloat_AsDouble(r.get());
  if (PyErr_Occurred()) return false;
  e->flops_model = borrowed(f->cost_model);
  return true;
}

// --------------------------------------------------------------------- op info
// What this path knows of op overload ``func`` (mode._native_op_info's answer), cached per overload until a
// hidden-write rule is registered (effects._generation changes).
const OpInfo* op_info(PyObject* func) {
  // (the effects module's dict, read directly: a module attribute lookup first walks the module type's MRO)
  PyObject* gen = PyDict_GetItemWithError(env.effects_dict, names._generation);
  if (gen == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "dtr.runtime.effects has no _generation");
    return nullptr;
  }
  long g = PyLong_AsLong(gen);
  if (g != op_generation) {
    op_infos.clear();
    op_keepalive.clear();
    op_generation = g;
  }
  auto it = op_infos.find(func);
  if (it != op_infos.end()) return &it->second;
  Ref r = call1(env.op_info, func);
  if (!r) return nullptr;
  OpInfo info;
  PyObject *fast, *seeded, *name, *call, *inplace;
  if (!PyArg_ParseTuple(r.get(), "OOOOO", &fast, &seeded, &name, &call, &inplace)) return nullptr;
  info.fast = PyObject_IsTrue(fast) == 1;
  info.inplace = PyObject_IsTrue(inplace) == 1;
  info.seeded = PyObject_IsTrue(seeded) == 1;
  info.name = borrowed(name);
  info.call = borrowed(call);
  op_keepalive.push_back(borrowed(func));
  return &op_infos.emplace(func, std::move(info)).first->second;
}

// Twin of PredictionCache.clear (dtr/runtime/prediction.py), and the op cache with it (dtr._native.clear_cache).
void prediction_clear() {
  predictions.clear();
  op_infos.clear();
  op_keepalive.clear();
}

}  // namespace dtr::native
