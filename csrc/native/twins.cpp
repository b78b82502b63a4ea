// twins.cpp - dtr._native._twin(name, fastpath, *args): one C++ twin of a Python function, called alone, for the
// unit-level differential tests (tests/native/test_twins.py) that pair each twin with its Python original.
//
// Note [Testing the twins]
// The end-to-end tests compare whole recorded logs of the two per-op paths; a twin that diverged in a case the
// programs never reach would go unseen. So each twin can be called by name on a block's FastPath, with
// Python arguments, and its effect on the same state compared with its Python twin's. The adapters only
// convert arguments and results; they add no logic of their own.
#include "fastpath.h"

#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>

namespace dtr::native {

namespace {

long arg_long(PyObject* o) { return PyLong_AsLong(o); }

// The Buf under core storage s in the table's phys, borrowed (null with no error if there is none).
PyObject* phys_buf(FastPath* f, long s) {
  Ref key(cached_int(s));
  return key ? PyDict_GetItemWithError(tget(f, T::phys), key.get()) : nullptr;
}

PyObject* bool_result(bool ok, bool value) {
  if (!ok) return nullptr;
  return PyBool_FromLong(value);
}

PyObject* call_twin(FastPath* f, const char* name, PyObject* const* a, Py_ssize_t n) {
  auto want = [&](Py_ssize_t k) {
    if (n == k) return true;
    PyErr_Format(PyExc_TypeError, "_twin(%s): %zd arguments after the FastPath, not %zd", name, k, n);
    return false;
  };
  if (!std::strcmp(name, "table_new_handle")) {  // StorageTable.new_handle()
    if (!want(0)) return nullptr;
    PyObject* h = table_new_handle(f);
    Py_XINCREF(h);
    return h;
  }
  if (!std::strcmp(name, "table_add")) {  // StorageTable.add(t, s, st, buf) -> handle
    if (!want(4)) return nullptr;
    if (!THPStorage_Check(a[2])) return PyErr_Format(PyExc_TypeError, "table_add: st must be a storage");
    c10::StorageImpl* impl = THPStorage_Unpack(a[2]).unsafeGetStorageImpl();
    return table_add(f, arg_long(a[0]), static_cast<int>(arg_long(a[1])), impl, a[3]).release();
  }
  if (!std::strcmp(name, "table_write")) {  // StorageTable.write(old, new, so, sn, st) (st: a tensor here)
    if (!want(5)) return nullptr;
    if (!THPVariable_Check(a[4])) return PyErr_Format(PyExc_TypeError, "table_write: st must be a tensor");
    return table_write(f, arg_long(a[0]), arg_long(a[1]), static_cast<int>(arg_long(a[2])),
                       static_cast<int>(arg_long(a[3])), THPVariable_Unpack(a[4])).release();
  }
  if (!std::strcmp(name, "table_drop")) {  // StorageTable.drop(h) -> t
    if (!want(1)) return nullptr;
    return table_drop(f, a[0]).release();
  }
  if (!std::strcmp(name, "table_computed_from")) {  // StorageTable.computed_from(ins, storage_of)
    if (!want(1)) return nullptr;
    Ref seq(PySequence_Fast(a[0], "table_computed_from: ins must be a sequence"));
    if (!seq) return nullptr;
    std::vector<long> ins;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq.get()); ++k)
      ins.push_back(PyLong_AsLong(PySequence_Fast_GET_ITEM(seq.get(), k)));
    if (PyErr_Occurred() || !table_computed_from(f, ins)) return nullptr;
    Py_RETURN_NONE;
  }
  if (!std::strcmp(name, "table_hold")) {  // StorageTable.hold(s)
    if (!want(1)) return nullptr;
    PyObject* b = phys_buf(f, arg_long(a[0]));
    if (b == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
    PyObject* weak = slot_at(b, env.buf_weak);
    if (weak != nullptr && weak != Py_None) {
      Ref key(cached_int(arg_long(a[0])));
      if (!key || !table_hold(tget(f, T::phys), key.get(), weak)) return nullptr;
    }
    Py_RETURN_NONE;
  }
  if (!std::strcmp(name, "table_pinned")) {  // StorageTable.pinned(s, strongly)
    if (!want(2)) return nullptr;
    Ref key(cached_int(arg_long(a[0])));
    int strongly = PyObject_IsTrue(a[1]);
    if (!key || strongly < 0 || !table_pinned(f, key.get(), strongly != 0)) return nullptr;
    Py_RETURN_NONE;
  }
  if (!std::strcmp(name, "buf_dead")) {  // Buf.dead()
    if (!want(1)) return nullptr;
    int d = buf_dead(a[0]);
    return d < 0 ? nullptr : PyBool_FromLong(d);
  }
  if (!std::strcmp(name, "buf_get")) {  // Buf.get() -> the storage's address (UntypedStorage._cdata), or None
    if (!want(1)) return nullptr;
    c10::StorageImpl* impl = buf_get(a[0]);
    if (impl == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
    return PyLong_FromVoidPtr(impl);
  }
  if (!std::strcmp(name, "liveness_due")) {  // Liveness.due(ops_seen, need)
    if (!want(2)) return nullptr;
    long ops = arg_long(a[0]);
    int64_t need = PyLong_AsLongLong(a[1]);
    if (PyErr_Occurred()) return nullptr;
    return PyBool_FromLong(liveness_due(f, ops, need));
  }
  if (!std::strcmp(name, "liveness_saw")) {  // Liveness.saw(handles)
    if (!want(1)) return nullptr;
    if (!liveness_saw(f, borrowed(a[0]))) return nullptr;
    Py_RETURN_NONE;
  }
  if (!std::strcmp(name, "liveness_release")) {  // Liveness.release(h)
    if (!want(1)) return nullptr;
    if (!liveness_release(f, a[0])) return nullptr;
    Py_RETURN_NONE;
  }
  if (!std::strcmp(name, "liveness_worth_keeping")) {  // Liveness.worth_keeping(s)
    if (!want(1)) return nullptr;
    std::vector<int> targets;
    int k = liveness_worth_keeping(f, static_cast<int>(arg_long(a[0])), targets);
    return bool_result(k >= 0, k == 1);
  }
  if (!std::strcmp(name, "mode_track")) {  // Driver._track(x) -> t
    if (!want(1)) return nullptr;
    if (!THPVariable_Check(a[0])) return PyErr_Format(PyExc_TypeError, "mode_track: x must be a tensor");
    long t = mode_track(f, a[0]);
    return t < 0 ? nullptr : PyLong_FromLong(t);
  }
  if (!std::strcmp(name, "mode_constant")) {  // Driver._constant(st) -> t
    if (!want(1)) return nullptr;
    return mode_constant(f, a[0]);
  }
  if (!std::strcmp(name, "mode_carried")) {  // Driver._carried() -> [Buf]
    if (!want(0)) return nullptr;
    return mode_carried(f);
  }
  return PyErr_Format(PyExc_ValueError, "_twin: no twin named %s", name);
}

}  // namespace

PyObject* twin(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n < 2 || !PyUnicode_Check(args[0]) || !PyObject_TypeCheck(args[1], &FastPathType))
    return PyErr_Format(PyExc_TypeError, "_twin(name, fastpath, *args)");
  const char* name = PyUnicode_AsUTF8(args[0]);
  if (name == nullptr) return nullptr;
  try {
    return call_twin(reinterpret_cast<FastPath*>(args[1]), name, args + 2, n - 2);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr native per-op path: %s", e.what());
    return nullptr;
  }
}

}  // namespace dtr::native
