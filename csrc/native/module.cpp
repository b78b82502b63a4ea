// module.cpp - the Python face of dtr._native (Note [The native per-op path] in fastpath.cpp): the FastPath
// type (a Driver's __torch_dispatch__ in C++, and the core's hooks while it runs), configure() and the module.
#include "fastpath.h"

#include <exception>
#include <tuple>

#ifndef DTR_TORCH_VERSION
#error "DTR_TORCH_VERSION must name the torch this module is built against (setup.py defines it)"
#endif

namespace dtr::native {

PyTypeObject FastPathType = {PyVarObject_HEAD_INIT(nullptr, 0)};

namespace {

// ------------------------------------------------------------- the Python type
int on_evict_hook(void* ctx, int s, int by_heuristic);

// No C++ exception may cross into Python (torch's accessors throw c10::Error): one barrier for both entries.
PyObject* guarded_call(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs) {
  try {
    return mode_torch_dispatch(f, func, types, args, kwargs, nullptr);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr native per-op path: %s", e.what());
    return nullptr;
  }
}

PyObject* FastPath_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* kw[] = {"func", "types", "args", "kwargs", nullptr};
  PyObject *func, *types, *a = nullptr, *k = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OO", const_cast<char**>(kw), &func, &types, &a, &k))
    return nullptr;
  Ref empty;
  if (a == nullptr) {
    empty = Ref(PyTuple_New(0));
    a = empty.get();
  }
  return guarded_call(reinterpret_cast<FastPath*>(self), func, types, a, k);
}

// Vectorcall: torch calls __torch_dispatch__(func, types, args, kwargs) positionally.
PyObject* FastPath_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr || n < 2 || n > 4) {
    Ref t(PyTuple_New(n));
    if (!t) return nullptr;
    for (Py_ssize_t i = 0; i < n; ++i) { Py_INCREF(args[i]); PyTuple_SET_ITEM(t.get(), i, args[i]); }
    Ref kw;
    if (kwnames != nullptr) {
      kw = Ref(PyDict_New());
      if (!kw) return nullptr;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i)
        if (PyDict_SetItem(kw.get(), PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0) return nullptr;
    }
    return FastPath_call(self, t.get(), kw.get());
  }
  Ref empty;
  PyObject* a = n > 2 ? args[2] : nullptr;
  if (a == nullptr) {
    empty = Ref(PyTuple_New(0));
    a = empty.get();
  }
  return guarded_call(reinterpret_cast<FastPath*>(self), args[0], args[1], a, n > 3 ? args[3] : nullptr);
}

int FastPath_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  PyObject *mode, *fallback;
  static const char* kw[] = {"mode", "fallback", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", const_cast<char**>(kw), &mode, &fallback)) return -1;
  if (!env.ready) {
    PyErr_SetString(PyExc_RuntimeError, "dtr._native.configure() was not called");
    return -1;
  }
  if (!PyObject_TypeCheck(mode, mode_type)) {
    PyErr_SetString(PyExc_TypeError, "FastPath(mode, ...): mode must be a Driver");
    return -1;
  }
  Py_INCREF(mode); f->mode = mode;
  for (auto [slot, type, out, what] : {std::make_tuple(S::table, table_type, &f->table, "table must be a StorageTable"),
                                       std::make_tuple(S::liveness, liveness_type, &f->liveness,
                                                       "liveness must be a Liveness")}) {
    PyObject* o = mget(f, slot);
    if (o == nullptr || !PyObject_TypeCheck(o, type)) {
      PyErr_Format(PyExc_TypeError, "FastPath(mode, ...): mode.%s", what);
      return -1;
    }
    Py_INCREF(o);
    *out = o;
  }
  Py_INCREF(fallback); f->fallback = fallback;
  Ref facade(PyObject_GetAttr(mode, names.core));
  if (!facade) return -1;
  f->core = PyObject_GetAttr(facade.get(), names._core);
  if (f->core == nullptr) return -1;
  Ref capsule(PyObject_CallMethod(f->core, "_capsule", nullptr));
  if (!capsule) return -1;
  f->c = PyCapsule_GetPointer(capsule.get(), DTR_CORE_CAPSULE);
  if (f->c == nullptr) return -1;
  for (PyObject* name : {names.on_compute, names.on_pin}) {  // this path's hooks replace the reference's
    Ref hook(PyObject_GetAttr(self, name));      // (Budget's end clears every hook)
    if (!hook || PyObject_SetAttr(f->core, name, hook.get()) < 0) return -1;
  }
  if (api->set_evict_hook(f->c, on_evict_hook, self) < 0) return -1;  // (a C function: one per eviction)
  api->set_compute_hook_first(f->c, 0);  // (Driver._on_compute has nothing to do for a first computation)
  f->cost_model = PyObject_GetAttr(mode, names.cost_model);
  if (f->cost_model == nullptr) return -1;
  Ref measured(PyObject_GetAttr(f->cost_model, names.measured));
  if (!measured) return -1;
  f->measured = PyObject_IsTrue(measured.get()) == 1;
  f->device = c10::DeviceType::CPU;
  f->device_name = nullptr;
  f->native_ops = f->fallback_ops = 0;
  return 0;
}

void FastPath_clear_refs(FastPath* f) {
  Py_CLEAR(f->owner);
  Py_CLEAR(f->mode); Py_CLEAR(f->table); Py_CLEAR(f->liveness); Py_CLEAR(f->fallback); Py_CLEAR(f->core); Py_CLEAR(f->cost_model);
  Py_CLEAR(f->device_name);
}

int FastPath_traverse(PyObject* self, visitproc visit, void* arg) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  Py_VISIT(f->mode); Py_VISIT(f->table); Py_VISIT(f->liveness); Py_VISIT(f->fallback); Py_VISIT(f->core); Py_VISIT(f->cost_model);
  return 0;
}

int FastPath_tp_clear(PyObject* self) {
  FastPath_clear_refs(reinterpret_cast<FastPath*>(self));
  return 0;
}

void FastPath_dealloc(PyObject* self) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  PyObject_GC_UnTrack(self);
  FastPath_clear_refs(f);
  Py_TYPE(self)->tp_free(self);
}

PyObject* FastPath_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  FastPath* f = reinterpret_cast<FastPath*>(self);
  f->vectorcall = FastPath_vectorcall;
  return self;
}

// torch requires a mode's __torch_dispatch__.__self__ to be the mode: the dispatch mode this path is the
// __torch_dispatch__ of (dtr/runtime/entry.py's NativeMode sets it, held weakly), else the driver.
PyObject* FastPath_self(PyObject* self, void*) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  PyObject* m = f->owner != nullptr ? PyWeakref_GetObject(f->owner) : f->mode;
  if (m == nullptr || m == Py_None) Py_RETURN_NONE;
  Py_INCREF(m);
  return m;
}

int FastPath_set_self(PyObject* self, PyObject* value, void*) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  PyObject* ref = value != nullptr && value != Py_None ? PyWeakref_NewRef(value, nullptr) : nullptr;
  if (value != nullptr && value != Py_None && ref == nullptr) return -1;
  Py_XSETREF(f->owner, ref);
  return 0;
}

PyObject* FastPath_counts(PyObject* self, void*) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  return Py_BuildValue("(KK)", static_cast<unsigned long long>(f->native_ops),
                       static_cast<unsigned long long>(f->fallback_ops));
}

// The core's on_evict hook while this path runs (a C function: Note [The core's C route] in core_api.h):
// mode_on_evict, with no C++ exception let into the core. 0, or -1 with a Python exception set.
int on_evict_hook(void* ctx, int s, int /*by_heuristic*/) {
  try {
    return mode_on_evict(reinterpret_cast<FastPath*>(ctx), s);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr native per-op path: %s", e.what());
    return -1;
  }
}

PyObject* FastPath_on_evict(PyObject* self, PyObject* const* args, Py_ssize_t n) {  // (the same, from Python)
  if (n < 1 || !PyLong_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "on_evict(storage, by_heuristic)");
    return nullptr;
  }
  long s = PyLong_AsLong(args[0]);
  if (s == -1 && PyErr_Occurred()) return nullptr;
  if (on_evict_hook(self, static_cast<int>(s), 0) < 0) return nullptr;
  Py_RETURN_NONE;
}

// The core's on_compute hook (op, remat) while this path runs: Driver._on_compute has work only for a
// recomputation; a first computation (every op this path runs) ends here.
PyObject* FastPath_on_compute(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  if (n < 2) {
    PyErr_SetString(PyExc_TypeError, "on_compute(op, remat)");
    return nullptr;
  }
  int remat = PyObject_IsTrue(args[1]);
  if (remat < 0) return nullptr;
  if (!remat) Py_RETURN_NONE;
  return PyObject_CallMethodObjArgs(f->mode, names._on_compute, args[0], args[1], nullptr);
}

// Driver._constant on this path (mode_constant).
PyObject* FastPath_constant(PyObject* self, PyObject* st) {
  try {
    return mode_constant(reinterpret_cast<FastPath*>(self), st);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr native per-op path: %s", e.what());
    return nullptr;
  }
}

// Driver._carried on this path (mode_carried).
PyObject* FastPath_carried(PyObject* self, PyObject*) {
  return mode_carried(reinterpret_cast<FastPath*>(self));
}

// The core's on_pin hook (storage) while this path runs: Driver._on_pin's steps (mode_on_pin).
PyObject* FastPath_on_pin(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  if (n < 1 || !PyLong_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "on_pin(storage)");
    return nullptr;
  }
  if (!mode_on_pin(reinterpret_cast<FastPath*>(self), args[0])) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef FastPath_methods[] = {
    {"constant", FastPath_constant, METH_O,
     "constant(storage) -> core tensor: Driver._constant on this path (a storage from before the block)."},
    {"carried", FastPath_carried, METH_NOARGS,
     "carried() -> [Buf]: Driver._carried on this path (what the next block on the device counts)."},
    {"on_pin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastPath_on_pin)), METH_FASTCALL,
     "The core's on_pin hook while this path runs (Driver._on_pin's steps)."},
    {"on_compute", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastPath_on_compute)), METH_FASTCALL,
     "The core's on_compute hook while this path runs (Driver._on_compute for a recomputation)."},
    {"on_evict", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastPath_on_evict)), METH_FASTCALL,
     "The core's on_evict hook while this path runs (Driver._on_evict where it has work)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef FastPath_getset[] = {
    {"__self__", FastPath_self, FastPath_set_self, "the mode (as for a bound method); settable", nullptr},
    {"counts", FastPath_counts, nullptr, "(ops run here, ops handed to the reference)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// ---------------------------------------------------------------------- module
PyObject* configure(PyObject*, PyObject* kwargs_dict) {
  if (!PyDict_Check(kwargs_dict)) {
    PyErr_SetString(PyExc_TypeError, "configure(env: dict)");
    return nullptr;
  }
  auto item = [&](const char* name) -> PyObject* {
    PyObject* v = PyDict_GetItemString(kwargs_dict, name);
    if (v == nullptr) PyErr_Format(PyExc_KeyError, "configure: missing %s", name);
    else Py_INCREF(v);  // kept for the life of the process
    return v;
  };
  PyObject* buf = item("Buf");
  if (buf == nullptr || !PyType_Check(buf)) return nullptr;
  env.buf_type = reinterpret_cast<PyTypeObject*>(buf);
  env.buf_weak = slot_offset(env.buf_type, "weak");
  env.buf_strong = slot_offset(env.buf_type, "strong");
  env.buf_shared = slot_offset(env.buf_type, "shared");
  env.buf_dropped = slot_offset(env.buf_type, "dropped");
  if (env.buf_weak < 0 || env.buf_strong < 0 || env.buf_shared < 0 || env.buf_dropped < 0) {
    PyErr_SetString(PyExc_TypeError, "configure: Buf must have the slots weak, strong, shared, dropped");
    return nullptr;
  }
  PyObject* mode_cls = item("Mode");
  if (mode_cls == nullptr || !PyType_Check(mode_cls)) return nullptr;
  mode_type = reinterpret_cast<PyTypeObject*>(mode_cls);
  for (int i = 0; i < static_cast<int>(S::count); ++i) {
    if ((mode_slots[i] = slot_offset(mode_type, kSlotNames[i])) < 0) {
      PyErr_Format(PyExc_TypeError, "configure: Mode must have the slot %s", kSlotNames[i]);
      return nullptr;
    }
  }
  PyObject* recomputer_cls = item("Recomputer");
  if (recomputer_cls == nullptr || !PyType_Check(recomputer_cls)) return nullptr;
  if ((recipes_slot = slot_offset(reinterpret_cast<PyTypeObject*>(recomputer_cls), "recipes")) < 0) {
    PyErr_SetString(PyExc_TypeError, "configure: Recomputer must have the slot recipes");
    return nullptr;
  }
  auto find_slots = [&](const char* what, PyTypeObject** type, const char* const* names_, Py_ssize_t* offsets,
                        int n) {
    PyObject* cls = item(what);
    if (cls == nullptr || !PyType_Check(cls)) return false;
    *type = reinterpret_cast<PyTypeObject*>(cls);
    for (int i = 0; i < n; ++i) {
      if ((offsets[i] = slot_offset(*type, names_[i])) < 0) {
        PyErr_Format(PyExc_TypeError, "configure: %s must have the slot %s", what, names_[i]);
        return false;
      }
    }
    return true;
  };
  if (!find_slots("Table", &table_type, kTableSlotNames, table_slots, static_cast<int>(T::count)) ||
      !find_slots("Liveness", &liveness_type, kLivenessSlotNames, liveness_slots, static_cast<int>(L::count)))
    return nullptr;
  if (!(env.slot_type = item("Slot")) || !(env.recipe_type = item("Recipe")) ||
      !(env.wall_timer = item("WallTimer")) ||
      !(env.translated = item("TRANSLATED")) ||
      !(env.rng_capture = item("rng_capture")) || !(env.size_warning = item("size_warning")) ||
      !(env.op_info = item("op_info")) || !(env.effects = item("effects")) ||
      !(env.name_failure = item("name_failure")))
    return nullptr;
  if (!PyModule_Check(env.effects) || (env.effects_dict = PyModule_GetDict(env.effects)) == nullptr) {
    PyErr_SetString(PyExc_TypeError, "configure: effects must be the dtr.runtime.effects module");
    return nullptr;
  }
  PyObject *recent = item("RECENT_OPS"), *gc_min = item("GC_MIN_OPS"), *maxp = item("MAX_PREDICTIONS");
  PyObject* maxv = item("MAX_VERSIONS");
  if (!recent || !gc_min || !maxp || !maxv) return nullptr;
  env.max_versions = PyLong_AsLong(maxv);
  env.recent_ops = PyLong_AsLong(recent);
  env.gc_min_ops = PyLong_AsLong(gc_min);
  env.max_predictions = PyLong_AsSize_t(maxp);
  if (PyErr_Occurred()) return nullptr;
  Ref c_module(PyImport_ImportModule("dtr._C"));
  Ref table(c_module ? PyObject_GetAttrString(c_module.get(), "_core_api") : nullptr);
  if (!table) return nullptr;
  api = static_cast<const DtrCoreApi*>(PyCapsule_GetPointer(table.get(), DTR_CORE_API_CAPSULE));
  if (api == nullptr) return nullptr;
  if (api->version != DTR_CORE_API_VERSION) {
    PyErr_Format(PyExc_ImportError, "dtr._C's core table is version %d, dtr._native expects %d: rebuild both",
                 api->version, DTR_CORE_API_VERSION);
    return nullptr;
  }
  env.ready = true;
  Py_RETURN_NONE;
}

PyObject* buf_dead_py(PyObject*, PyObject* b) {  // for tests: this module's reading of Buf.dead()
  if (!env.ready || !PyObject_TypeCheck(b, env.buf_type)) {
    PyErr_SetString(PyExc_TypeError, "buf_dead(Buf) after configure()");
    return nullptr;
  }
  int d = buf_dead(b);
  if (d < 0) return nullptr;
  return PyBool_FromLong(d);
}

PyObject* clear_cache(PyObject*, PyObject*) {
  prediction_clear();
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"configure", configure, METH_O, "configure(env): the reference's classes and helpers (dtr/runtime/native.py)."},
    {"buf_dead", buf_dead_py, METH_O, "buf_dead(buf): Buf.dead() as this module reads it."},
    {"clear_cache", clear_cache, METH_NOARGS, "Forget every cached signature and op."},
    {"key_enter", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(key_enter)), METH_FASTCALL,
     "key_enter(fastpath, reference): take the dispatch key for this block; False if another block has it."},
    {"key_exit", key_exit, METH_NOARGS, "key_exit(): give the dispatch key back."},
    {"key_exclude", key_exclude, METH_O, "key_exclude(flag) -> previous: skip the key in this thread."},
    {"key_active", key_active, METH_NOARGS, "key_active(): whether this thread's ops go to the key's entry now."},
    {"_twin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(twin)), METH_FASTCALL,
     "_twin(name, fastpath, *args): one C++ twin of a Python function, alone (Note [Testing the twins])."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dtr._native",
                          "The runtime's per-op path in C++ (see Note [The native per-op path]).", -1,
                          module_methods};

}  // namespace
}  // namespace dtr::native

PyMODINIT_FUNC PyInit__native() {
  using namespace dtr::native;
  if (!intern_names()) return nullptr;
  FastPathType.tp_name = "dtr._native.FastPath";
  FastPathType.tp_basicsize = sizeof(FastPath);
  FastPathType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  FastPathType.tp_doc = "FastPath(mode, fallback): a Driver's __torch_dispatch__ in C++.";
  FastPathType.tp_new = FastPath_new;
  FastPathType.tp_init = FastPath_init;
  FastPathType.tp_dealloc = FastPath_dealloc;
  FastPathType.tp_traverse = FastPath_traverse;
  FastPathType.tp_clear = FastPath_tp_clear;
  FastPathType.tp_call = FastPath_call;
  FastPathType.tp_getset = FastPath_getset;
  FastPathType.tp_methods = FastPath_methods;
  FastPathType.tp_vectorcall_offset = offsetof(FastPath, vectorcall);
  if (PyType_Ready(&FastPathType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&FastPathType);
  if (PyModule_AddObject(m, "FastPath", reinterpret_cast<PyObject*>(&FastPathType)) < 0 ||
      PyModule_AddStringConstant(m, "TORCH_VERSION", DTR_TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "CXX11_ABI", _GLIBCXX_USE_CXX11_ABI) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
