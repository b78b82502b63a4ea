// py_object.h - dtr._native's Python-object helpers, shared by every unit (Note [The native per-op path] in
// fastpath.cpp): owned references, small ints, interned names, the reference's classes and helpers (the Env,
// set by configure()), and the slots of the reference's objects this path reads at fixed offsets.
#pragma once

#include <Python.h>
#include <structmember.h>

#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace dtr::native {

// ------------------------------------------------------------------ references
struct Ref {  // an owned reference
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& o) noexcept : p(o.p) { o.p = nullptr; }
  Ref& operator=(Ref&& o) noexcept { std::swap(p, o.p); return *this; }
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
  PyObject* release() { PyObject* r = p; p = nullptr; return r; }
  explicit operator bool() const { return p != nullptr; }
};

inline Ref borrowed(PyObject* o) { Py_XINCREF(o); return Ref(o); }

inline Ref call1(PyObject* fn, PyObject* a) { return Ref(PyObject_CallOneArg(fn, a)); }

// ----------------------------------------------------------------- environment
// Set once by configure() (dtr/runtime/native.py): the reference's classes and helpers.
struct Env {
  PyObject* slot_type = nullptr;      // recompute.Slot
  PyObject* recipe_type = nullptr;    // recompute.Recipe
  PyTypeObject* buf_type = nullptr;   // storage_table.Buf
  Py_ssize_t buf_weak = 0, buf_strong = 0, buf_shared = 0, buf_dropped = 0;  // its slots' offsets
  PyObject* wall_timer = nullptr;     // timing.WallTimer
  PyObject* translated = nullptr;     // core._TRANSLATED
  PyObject* rng_capture = nullptr;    // recompute.rng_capture
  PyObject* size_warning = nullptr;   // mode._size_warning(func, got, predicted)
  PyObject* op_info = nullptr;        // mode._native_op_info(func) -> (fast, seeded, name, call, inplace)
  PyObject* name_failure = nullptr;   // failures.name_failure(mode, exc, func)
  PyObject* effects = nullptr;        // the effects module (its _generation)
  PyObject* effects_dict = nullptr;   // its __dict__ (borrowed from the module, which is kept)
  // The runtime's limits (dtr/runtime/limits.py, their one owner): configure() sets them; none has a default.
  long recent_ops = 0, gc_min_ops = 0, max_versions = 0;
  size_t max_predictions = 0;
  bool ready = false;
};
inline Env env;

// Interned attribute names.
#define DTR_NAMES(X)                                                                                        \
  X(poll) X(collect) X(_native_predict) X(call) X(release) X(_generation) X(sizes) X(owning) X(metas) \
  X(estimate) X(mutated) X(device) X(__exit__) X(cost_model) X(measured) X(untyped_storage) \
  X(schedule) X(_core) X(core) X(_on_evict) X(on_compute) X(_on_compute) X(on_pin) X(constant) \
  X(_set_device) X(pin) X(protect) X(_protect_written) X(_pin_if_volatile)
struct Names {
#define DTR_DECL(n) PyObject* n = nullptr;
  DTR_NAMES(DTR_DECL)
#undef DTR_DECL
};
inline Names names;

inline bool intern_names() {
#define DTR_INTERN(n) if (!(names.n = PyUnicode_InternFromString(#n))) return false;
  DTR_NAMES(DTR_INTERN)
#undef DTR_INTERN
  return true;
}

// ----------------------------------------------------------------------- slots
// The attributes this path reads or writes on every op: slots of Driver (Note [The driver's slots] in
// dtr/runtime/driver.py), of its StorageTable (Note [The storage table] in dtr/runtime/storage_table.py) and
// of its Liveness (dtr/runtime/liveness.py), read at their offsets, found once by configure().
#define DTR_MODE_SLOTS(X)                                                                                    \
  X(device_type) X(_opaque_readers) X(timer) X(recorder) X(ops_seen) X(liveness) X(table) X(recomputer)      \
  X(_ops_at_gc) X(_live_after_gc) X(_volatile)
#define DTR_TABLE_SLOTS(X) X(version) X(cdata_of) X(phys) X(handle) X(alive) X(versions) X(_next_handle)
#define DTR_LIVENESS_SLOTS(X) X(recent) X(next_full_poll) X(on_schedule)
#define DTR_SLOT_ENUM(n) n,
#define DTR_SLOT_NAME(n) #n,
enum class S : int { DTR_MODE_SLOTS(DTR_SLOT_ENUM) count };
enum class T : int { DTR_TABLE_SLOTS(DTR_SLOT_ENUM) count };
enum class L : int { DTR_LIVENESS_SLOTS(DTR_SLOT_ENUM) count };
inline const char* const kSlotNames[] = {DTR_MODE_SLOTS(DTR_SLOT_NAME)};
inline const char* const kTableSlotNames[] = {DTR_TABLE_SLOTS(DTR_SLOT_NAME)};
inline const char* const kLivenessSlotNames[] = {DTR_LIVENESS_SLOTS(DTR_SLOT_NAME)};
#undef DTR_SLOT_ENUM
#undef DTR_SLOT_NAME
inline Py_ssize_t mode_slots[static_cast<int>(S::count)];
inline Py_ssize_t table_slots[static_cast<int>(T::count)];
inline Py_ssize_t liveness_slots[static_cast<int>(L::count)];
inline PyTypeObject* mode_type = nullptr;      // Driver
inline PyTypeObject* table_type = nullptr;     // StorageTable
inline PyTypeObject* liveness_type = nullptr;  // Liveness
inline Py_ssize_t recipes_slot = -1;           // Recomputer.recipes (dtr/runtime/recompute.py)

// A slot's offset in a __slots__ class (its member descriptor), or -1.
inline Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
  PyObject* d = PyDict_GetItemString(type->tp_dict, name);
  if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
  return reinterpret_cast<PyMemberDescrObject*>(d)->d_member->offset;
}

inline PyObject*& slot_at(PyObject* o, Py_ssize_t off) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
}

// ------------------------------------------------------------------------ ints
// A Python int, a new reference. Core ids (tensor, storage, op) and the mode's counters are small, and an
// id is looked up several times (its buffer, handle, recipe), so ints below kIdInts are made once and kept
// for the process (about 2 MiB at most): ids and counters start from 0 in every block.
constexpr long kIdInts = 1 << 16;
inline PyObject* cached_int(long v) {
  static std::vector<PyObject*>& cache = *new std::vector<PyObject*>();
  if (v < 0 || v >= kIdInts) return PyLong_FromLong(v);
  if (static_cast<size_t>(v) >= cache.size()) cache.resize(std::min<size_t>(kIdInts, 2 * v + 64), nullptr);
  PyObject*& slot = cache[v];
  if (slot == nullptr && (slot = PyLong_FromLong(v)) == nullptr) return nullptr;
  Py_INCREF(slot);
  return slot;
}

// ---------------------------------------------------------------------- errors
// A core method failed: raise what dtr.core's _TRANSLATED makes of its exception (one owner of that rule).
inline void translate_error() {
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (tb != nullptr && v != nullptr) PyException_SetTraceback(v, tb);
  PyObject* r = PyObject_CallMethodObjArgs(env.translated, names.__exit__, t ? t : Py_None, v ? v : Py_None,
                                           tb ? tb : Py_None, nullptr);
  if (r == nullptr) {  // translated: the new exception is set
    Py_XDECREF(t); Py_XDECREF(v); Py_XDECREF(tb);
    return;
  }
  Py_DECREF(r);
  PyErr_Restore(t, v, tb);
}

// --------------------------------------------------------------------- records
// Note [Untracked records]
// The records this path leaves behind for every op (a Buf, a Recipe with its
// leaves, Slots and output pairs) live as long as their storage or op, and
// Python's cyclic GC would traverse each of them at every full collection: a
// block's full collections scan everything the block created (budget.py's
// Note [Garbage collection during a block]), about a quarter of this path's
// time on a chain of small ops. None of them can be part of a reference cycle
// (recompute.py's Note [Recipes and the cyclic GC]: they hold ops, ints, tuples,
// dtypes, storages and generator states, nothing that refers back to a
// record), so they are untracked when made: they are freed by reference
// counting as before, and the collector never visits them.
inline void untrack(PyObject* o) {
  if (PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
}

// A tuple of the ints v, a new reference (untracked: ints only).
inline PyObject* int_tuple(c10::IntArrayRef v) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < v.size(); ++i) {
    PyObject* x = PyLong_FromLongLong(v[i]);
    if (x == nullptr) { Py_DECREF(t); return nullptr; }
    PyTuple_SET_ITEM(t, i, x);
  }
  untrack(t);  // (ints only)
  return t;
}

}  // namespace dtr::native
