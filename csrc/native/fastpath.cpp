// dtr._native: the runtime's per-op path in C++, built against torch.
//
// Note [The native per-op path]
// DTRMode.__torch_dispatch__ (dtr/runtime/mode.py) is the reference: every
// rule of the runtime is written there, in Python. This module runs the
// common op through the same steps without the interpreter: an op whose
// tensor arguments are all strided tensors on the budget's device, that writes
// nothing (by its schema or a hidden-write rule), whose output sizes the
// meta run predicted, and whose cost is known at once (the CPU's wall clock,
// or the flop model). It reads and writes the *same* state the reference
// keeps (the storage table's maps and Buf records, the recipes), in the same order,
// and calls the core through the same bound methods, so the two paths can be
// interleaved op by op and make the same decisions; tests/test_native.py runs
// the runtime's tests on both and compares recorded logs line by line.
// Anything else (first sight of a signature, ops that write, factories,
// escapes, other layouts, CUDA event timing, full polls that find a dead
// constant, partial polls whose dead constants need more than settle_constants
// does, collection, recomputation and eviction, which run from the core's hooks) is the
// reference's own code, called from here. The core (dtr._C) stays torch-free:
// this module reaches it only through the C table dtr._C exports for it
// (csrc/core_api.h, Note [The core's C route]).
//
// What is cached here, and why it cannot go stale:
//  * per op overload: whether it may take this path (no writes, not set_),
//    whether it is random, and its log name. Cleared when a hidden-write rule
//    is registered (effects._generation changes).
//  * per signature (op, the structure of its arguments, every tensor's shape,
//    strides and dtype, every other argument's value): the reference's
//    prediction (output sizes, positions), its flatten spec, the layouts its
//    recipes record, and the flop estimate. All are functions of the
//    signature. Process-wide, bounded like the reference's cache.
//  * Python ints below 65536 (cached_int: core ids and the mode's counters);
//    ints are immutable, so nothing here can go stale.
#include <Python.h>
#include <structmember.h>
#include <tuple>

#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "core_api.h"
#include "depth_pool.h"
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <vector>

#ifndef DTR_TORCH_VERSION
#error "DTR_TORCH_VERSION must name the torch this module is built against (setup.py defines it)"
#endif

namespace {

// ----------------------------------------------------------------- references
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

Ref borrowed(PyObject* o) { Py_XINCREF(o); return Ref(o); }

// --------------------------------------------------------------- environment
// Set once by configure() (dtr/runtime/native.py): the reference's classes and helpers.
struct Env {
  PyObject* slot_type = nullptr;      // mode.Slot
  PyObject* recipe_type = nullptr;    // mode.Recipe
  PyTypeObject* buf_type = nullptr;   // storage_table.Buf
  Py_ssize_t buf_weak = 0, buf_strong = 0, buf_shared = 0, buf_dropped = 0;  // its slots' offsets
  PyObject* wall_timer = nullptr;     // timing.WallTimer
  PyObject* translated = nullptr;     // core._TRANSLATED
  PyObject* rng_capture = nullptr;    // recompute.rng_capture
  PyObject* size_warning = nullptr;   // mode._size_warning(func, got, predicted)
  PyObject* op_info = nullptr;        // mode._native_op_info(func) -> (fast, seeded, name, call)
  PyObject* name_failure = nullptr;   // failures.name_failure(mode, exc, func)
  PyObject* effects = nullptr;        // the effects module (its _generation)
  PyObject* effects_dict = nullptr;   // its __dict__ (borrowed from the module, which is kept)
  long recent_ops = 4, gc_min_ops = 256, max_versions = 8;
  size_t max_predictions = 1 << 16;
  bool ready = false;
} env;

// Interned attribute names.
#define DTR_NAMES(X)                                                                                        \
  X(poll) X(collect) X(_native_predict) X(call) X(release) X(_generation) X(sizes) X(owning) X(metas) \
  X(estimate) X(mutated) X(device) X(__exit__) X(cost_model) X(measured) X(untyped_storage) \
  X(schedule) X(_core) X(core) X(_on_evict) X(on_compute) X(_on_compute) X(on_pin) X(constant) \
  X(_set_device) X(pin) X(protect)
struct Names {
#define DTR_DECL(n) PyObject* n = nullptr;
  DTR_NAMES(DTR_DECL)
#undef DTR_DECL
} names;

// The attributes this path reads or writes on every op: slots of DTRMode (Note [The mode's slots] in
// dtr/runtime/mode.py), of its StorageTable (Note [The storage table] in dtr/runtime/storage_table.py) and
// of its Liveness (dtr/runtime/liveness.py), read at their offsets, found once by configure().
#define DTR_MODE_SLOTS(X)                                                                                    \
  X(device_type) X(_opaque_readers) X(timer) X(recorder) X(ops_seen) X(liveness) X(table) X(recomputer)      \
  X(_ops_at_gc) X(_live_after_gc)
#define DTR_TABLE_SLOTS(X) X(version) X(cdata_of) X(phys) X(handle) X(alive) X(versions) X(_next_handle)
#define DTR_LIVENESS_SLOTS(X) X(recent) X(next_full_poll) X(on_schedule)
#define DTR_SLOT_ENUM(n) n,
#define DTR_SLOT_NAME(n) #n,
enum class S : int { DTR_MODE_SLOTS(DTR_SLOT_ENUM) count };
enum class T : int { DTR_TABLE_SLOTS(DTR_SLOT_ENUM) count };
enum class L : int { DTR_LIVENESS_SLOTS(DTR_SLOT_ENUM) count };
const char* const kSlotNames[] = {DTR_MODE_SLOTS(DTR_SLOT_NAME)};
const char* const kTableSlotNames[] = {DTR_TABLE_SLOTS(DTR_SLOT_NAME)};
const char* const kLivenessSlotNames[] = {DTR_LIVENESS_SLOTS(DTR_SLOT_NAME)};
#undef DTR_SLOT_ENUM
#undef DTR_SLOT_NAME
Py_ssize_t mode_slots[static_cast<int>(S::count)];
Py_ssize_t table_slots[static_cast<int>(T::count)];
Py_ssize_t liveness_slots[static_cast<int>(L::count)];
PyTypeObject* mode_type = nullptr;      // DTRMode
PyTypeObject* table_type = nullptr;     // StorageTable
PyTypeObject* liveness_type = nullptr;  // Liveness
Py_ssize_t recipes_slot = -1;        // Recomputer.recipes (dtr/runtime/recompute.py)

bool intern_names() {
#define DTR_INTERN(n) if (!(names.n = PyUnicode_InternFromString(#n))) return false;
  DTR_NAMES(DTR_INTERN)
#undef DTR_INTERN
  return true;
}

// A slot's offset in a __slots__ class (its member descriptor), or -1.
Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
  PyObject* d = PyDict_GetItemString(type->tp_dict, name);
  if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
  return reinterpret_cast<PyMemberDescrObject*>(d)->d_member->offset;
}

PyObject*& slot_at(PyObject* o, Py_ssize_t off) { return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off); }

// --------------------------------------------------------------------- buffers
// The reference's Buf, read and made here (see storage_table.Buf). ``weak`` holds a raw
// weak pointer to the StorageImpl as an int (what UntypedStorage._weak_ref makes).
c10::StorageImpl* weak_ptr(PyObject* weak) { return static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(weak)); }

bool weak_expired(PyObject* weak) { return c10::raw::weak_intrusive_ptr::use_count(weak_ptr(weak)) == 0; }

// Buf.dead(). The reference's ``sys.getrefcount(strong) <= 2`` counts the call's own reference:
// here, no reference but the buffer's (tests/test_native.py checks that the two agree).
int buf_dead(PyObject* b) {
  PyObject* strong = slot_at(b, env.buf_strong);
  if (strong != nullptr && strong != Py_None) {
    PyObject* dropped = slot_at(b, env.buf_dropped);
    int d = dropped ? PyObject_IsTrue(dropped) : 0;
    if (d != 0) return d;
    PyObject* shared = slot_at(b, env.buf_shared);
    int sh = shared ? PyObject_IsTrue(shared) : 0;
    if (sh <= 0) return sh;
    if (!THPStorage_Check(strong)) return 0;
    const c10::Storage& st = THPStorage_Unpack(strong);
    return c10::raw::intrusive_ptr::use_count(st.unsafeGetStorageImpl()) <= 1 && Py_REFCNT(strong) <= 1;
  }
  PyObject* weak = slot_at(b, env.buf_weak);
  return weak != nullptr && weak != Py_None && weak_expired(weak);
}

// Whether Buf.get() is None: held weakly and expired.
bool buf_gone(PyObject* b) {
  PyObject* strong = slot_at(b, env.buf_strong);
  if (strong != nullptr && strong != Py_None) return false;
  PyObject* weak = slot_at(b, env.buf_weak);
  return weak == nullptr || weak == Py_None || weak_expired(weak);
}

// Buf(storage, owned=False): the program's buffer, held weakly.
PyObject* new_weak_buf(c10::StorageImpl* impl) {
  PyObject* b = env.buf_type->tp_alloc(env.buf_type, 0);
  if (b == nullptr) return nullptr;
  PyObject* weak = PyLong_FromVoidPtr(c10::raw::intrusive_ptr::make_weak(impl));
  if (weak == nullptr) { Py_DECREF(b); return nullptr; }
  slot_at(b, env.buf_weak) = weak;
  Py_INCREF(Py_None); slot_at(b, env.buf_strong) = Py_None;
  Py_INCREF(Py_False); slot_at(b, env.buf_shared) = Py_False;
  Py_INCREF(Py_False); slot_at(b, env.buf_dropped) = Py_False;
  PyObject_GC_UnTrack(b);  // see Note [Untracked records]
  return b;
}

// Buf(storage, owned=True, shared=True): a constant's buffer, held strongly (``storage`` is a Python storage).
PyObject* new_shared_buf(PyObject* storage) {
  PyObject* b = env.buf_type->tp_alloc(env.buf_type, 0);
  if (b == nullptr) return nullptr;
  Py_INCREF(Py_None); slot_at(b, env.buf_weak) = Py_None;
  Py_INCREF(storage); slot_at(b, env.buf_strong) = storage;
  Py_INCREF(Py_True); slot_at(b, env.buf_shared) = Py_True;
  Py_INCREF(Py_False); slot_at(b, env.buf_dropped) = Py_False;
  PyObject_GC_UnTrack(b);  // see Note [Untracked records]
  return b;
}

// Buf(torch.UntypedStorage(0, device=device), owned=True): what a version keeps once a write took its buffer.
PyObject* new_empty_owned_buf(const c10::Device& device) {
  c10::Storage empty(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), 0,
                                                           c10::DataPtr(nullptr, device),
                                                           c10::GetAllocator(device.type()), /*resizable=*/true));
  Ref storage(THPStorage_Wrap(std::move(empty)));
  if (!storage) return nullptr;
  PyObject* b = env.buf_type->tp_alloc(env.buf_type, 0);
  if (b == nullptr) return nullptr;
  Py_INCREF(Py_None); slot_at(b, env.buf_weak) = Py_None;
  slot_at(b, env.buf_strong) = storage.release();
  Py_INCREF(Py_False); slot_at(b, env.buf_shared) = Py_False;
  Py_INCREF(Py_False); slot_at(b, env.buf_dropped) = Py_False;
  PyObject_GC_UnTrack(b);  // see Note [Untracked records]
  return b;
}

// StorageTable.hold(key) for buffer b's ``weak``: replaced by one holding the storage strongly, if it is still
// there. False with a Python exception set on error.
bool hold_strongly(PyObject* phys, PyObject* key, PyObject* weak) {
  c10::StorageImpl* locked = c10::raw::weak_intrusive_ptr::lock(weak_ptr(weak));
  if (locked == nullptr) return true;  // (gone: Buf.get() is None)
  try {
    Ref st(THPStorage_Wrap(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim(locked))));
    Ref strong(st ? new_shared_buf(st.get()) : nullptr);
    return strong && PyDict_SetItem(phys, key, strong.get()) == 0;
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr native per-op path: %s", e.what());
    return false;
  }
}

// StorageTable.computed_from for one pinned input's storage s: a constant held weakly is held strongly from
// now on (Note [Constants held weakly]). False with a Python exception set on error.
bool hold_weak_constant(PyObject* phys, int s);  // (below, with the storage table's readers)

// Buf.get() for a buffer that is not dropped: the StorageImpl it holds, or null if it is gone.
c10::StorageImpl* buf_impl(PyObject* b) {
  PyObject* strong = slot_at(b, env.buf_strong);
  if (strong != nullptr && strong != Py_None)
    return THPStorage_Check(strong) ? THPStorage_Unpack(strong).unsafeGetStorageImpl() : nullptr;
  PyObject* weak = slot_at(b, env.buf_weak);
  return weak == nullptr || weak == Py_None || weak_expired(weak) ? nullptr : weak_ptr(weak);
}

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
void untrack(PyObject* o) {
  if (PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
}

// ------------------------------------------------------------------ signatures
enum Tag : int64_t { kTuple = 1, kList, kTensor, kNone, kFalse, kTrue, kInt, kFloat, kStr, kSingleton, kDevice,
                     kKwargs, kKey };

struct Leaf {
  PyObject* obj;  // borrowed
  bool tensor;
};

// One op's arguments, flattened in the reference's order (mode.tree_flatten), and its signature.
struct Scan {
  std::vector<int64_t> key;
  std::vector<Leaf> leaves;
  std::vector<int> tpos;  // leaf positions of the tensors
  c10::DeviceType device;
  bool ok = true;
};

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
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || t.is_meta() || !t.has_storage() ||
        t.key_set().has(c10::DispatchKey::Python) || t.device().type() != s.device)
      return false;  // untracked tensors, and wrapper subclasses (mode.py's Note [Tensor subclasses]): the reference
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

bool scan_args(PyObject* func, PyObject* args, PyObject* kwargs, Scan& s) {
  s.key.push_back(kKey);
  s.key.push_back(reinterpret_cast<int64_t>(func));
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

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

// One op's temporaries, kept between ops so that their vectors keep their capacity (an op made a dozen
// heap allocations for them): Note [Scratch by nesting depth] in depth_pool.h.
struct Scratch {
  Scan scan;
  std::vector<long> ins, new_tensors;
  std::vector<int> in_ids, outs;
  std::vector<PyObject*> flat, handles, dead;
  std::vector<at::Tensor> touts;  // through the key: the op's flattened outputs (undefined: not a tensor)
  bool outs_on_stack = false;     // (else `flat` holds them, as Python objects)
  std::vector<int64_t> all_sizes;  // an in-place op's begin_call
  std::vector<int> inplace_of;
  void clear() {
    scan.key.clear(); scan.leaves.clear(); scan.tpos.clear(); scan.ok = true;
    ins.clear(); new_tensors.clear(); in_ids.clear(); outs.clear(); flat.clear(); handles.clear(); dead.clear();
    touts.clear(); outs_on_stack = false;
  }
};

PyObject* int_tuple(c10::IntArrayRef v);  // (below)

// What the reference predicted for one signature, and what its recipes record.
struct Entry {
  bool ok = false;                       // sizes known and the leaves agree with the reference's
  std::vector<int64_t> sizes;            // bytes of each output that owns a new storage
  std::vector<int> owning;               // their positions among the flattened outputs
  int64_t total = 0;
  Ref func, spec, metas;                 // the op (kept alive: the key holds its address)
  std::vector<Ref> lay_size, lay_stride, lay_dtype;  // per tensor leaf: (shape, stride, dtype) as recorded
  double flops = -1;                     // the flop estimate, once computed
  Ref flops_model;                       // by this cost model (each has its own cache)
  // Per owning output, its last recorded (shape, stride) as tuples, shared by every recipe that records
  // equal ones: an output's layout is nearly always the signature's, and each tuple a recipe keeps is one
  // more allocation that counts towards the cyclic GC's next collection.
  std::vector<Ref> out_tuples[2];
  std::vector<std::vector<int64_t>> out_values[2];

  // A new reference to `cached` (a tuple of ints) if it holds v, else to a new tuple of v.
  static PyObject* out_layout_or(PyObject* cached, c10::IntArrayRef v) {
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
  PyObject* out_layout(size_t k, int which, c10::IntArrayRef v) {
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
};

// (Never destroyed: their references must not be released after the interpreter is gone.)
auto& predictions = *new std::unordered_map<std::vector<int64_t>, Entry, KeyHash>();

struct OpInfo {
  bool fast = false, seeded = false;
  bool inplace = false;  // may run as an in-place op on its first argument (mode._native_op_info)
  Ref name;
  Ref call;  // what runs the op (mode._native_op_info: the overload's C++ operator)
};
auto& op_infos = *new std::unordered_map<PyObject*, OpInfo>();  // keys kept alive by op_keepalive
auto& op_keepalive = *new std::vector<Ref>();
long op_generation = -1;

// ------------------------------------------------------------------- the path
const DtrCoreApi* api = nullptr;  // dtr._C's table (Note [The core's C route])

struct FastPath {
  PyObject_HEAD
  PyObject* mode;      // owned
  PyObject* table;     // mode.table (set once, in DTRMode.__init__), owned
  PyObject* liveness;  // mode.liveness (likewise), owned
  PyObject* fallback;  // DTRMode.__torch_dispatch__ (the class's function), owned
  PyObject* core;      // the wrapped _C.Core, owned (it keeps `c` alive)
  void* c;             // its address, for the C route (core_api.h)
  PyObject* cost_model;  // owned
  bool measured;
  c10::DeviceType device;
  PyObject* device_name;  // the mode's device_type when `device` was parsed (owned), or null
  uint64_t native_ops, fallback_ops;
  vectorcallfunc vectorcall;
  bool key_reference;  // through the dispatch key, every op to the reference (tests: the same op stream)
  PyObject* owner;     // a weak reference to the dispatch mode it is the __torch_dispatch__ of, or null (owned)
};

PyObject* mget(FastPath* f, S name) {  // the mode's slot, borrowed; null with no error set if it is unset
  return slot_at(f->mode, mode_slots[static_cast<int>(name)]);
}

long mget_long(FastPath* f, S name) {
  PyObject* v = mget(f, name);
  return v ? PyLong_AsLong(v) : -1;
}

PyObject* cached_int(long v);

bool mset_long(FastPath* f, S name, long v) {
  PyObject* o = cached_int(v);
  if (o == nullptr) return false;
  Py_XSETREF(slot_at(f->mode, mode_slots[static_cast<int>(name)]), o);
  return true;
}

PyObject* recipes_of(FastPath* f) {  // the mode's recipes (its Recomputer's), borrowed
  return slot_at(mget(f, S::recomputer), recipes_slot);
}

PyObject* tget(FastPath* f, T name) {  // the storage table's slot, borrowed (its maps are always set)
  return slot_at(f->table, table_slots[static_cast<int>(name)]);
}

PyObject* lget(FastPath* f, L name) {  // the liveness's slot, borrowed (always set)
  return slot_at(f->liveness, liveness_slots[static_cast<int>(name)]);
}

// A Python int, a new reference. Core ids (tensor, storage, op) and the mode's counters are small, and an
// id is looked up several times (its buffer, handle, recipe), so ints below kIdInts are made once and kept
// for the process (about 2 MiB at most): ids and counters start from 0 in every block.
constexpr long kIdInts = 1 << 16;
PyObject* cached_int(long v) {
  static std::vector<PyObject*>& cache = *new std::vector<PyObject*>();
  if (v < 0 || v >= kIdInts) return PyLong_FromLong(v);
  if (static_cast<size_t>(v) >= cache.size()) cache.resize(std::min<size_t>(kIdInts, 2 * v + 64), nullptr);
  PyObject*& slot = cache[v];
  if (slot == nullptr && (slot = PyLong_FromLong(v)) == nullptr) return nullptr;
  Py_INCREF(slot);
  return slot;
}

Ref call1(PyObject* fn, PyObject* a) { return Ref(PyObject_CallOneArg(fn, a)); }


// A core method failed: raise what dtr.core's _TRANSLATED makes of its exception (one owner of that rule).
void translate_error() {
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

// core.storage_of(t), through the core's C table (a bounds-checked read; -1 with an error set if t is unknown).
int storage_of(FastPath* f, long t) { return api->storage_of(f->c, static_cast<int>(t)); }


// The buffer of core storage s (borrowed), or null (with an error set if the lookup failed).
PyObject* phys_of(FastPath* f, PyObject* phys, int s) {
  Ref key(cached_int(s));
  if (!key) return nullptr;
  PyObject* b = PyDict_GetItemWithError(phys, key.get());
  if (b == nullptr && !PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%d", s);
  return b;
}

PyObject* constant(FastPath* f, PyObject* st);  // (below, with the methods)
int on_evict_hook(void* ctx, int s, int by_heuristic);

// DTRMode._track: the current version of x's storage; a constant on first sight.
// The version x's storage is now, if dtr tracks it and its buffer is alive: 1 with *version and *storage
// set; 0 if not (first sight, or the address of a storage that died since the last poll); -1 on error.
int live_version(FastPath* f, PyObject* x, long* version, int* storage) {
  const at::Tensor& t = THPVariable_Unpack(x);
  Ref cdata(PyLong_FromVoidPtr(t.storage().unsafeGetStorageImpl()));
  if (!cdata) return -1;
  PyObject* v = PyDict_GetItemWithError(tget(f, T::version), cdata.get());
  if (v == nullptr) return PyErr_Occurred() ? -1 : 0;
  long tv = PyLong_AsLong(v);
  int s = storage_of(f, tv);
  if (s < 0) return -1;
  PyObject* b = phys_of(f, tget(f, T::phys), s);
  if (b == nullptr) return -1;
  int dead = buf_dead(b);
  if (dead != 0) return dead < 0 ? -1 : 0;
  *version = tv;
  *storage = s;
  return 1;
}

long track(FastPath* f, PyObject* x) {
  long tv;
  int s;
  int live = live_version(f, x, &tv, &s);
  if (live < 0) return -1;
  if (live) return tv;
  // (the address of a storage that died since the last poll, reused; or first sight)
  Ref st(PyObject_CallMethodNoArgs(x, names.untyped_storage));
  if (!st) return -1;
  Ref r(constant(f, st.get()));
  return r ? PyLong_AsLong(r.get()) : -1;
}

// For an in-place op on x: the version x's storage is now, if the op can be this path's write (mode.py's
// _commit: a tracked storage, alive): 1 for a new version (not pinned), 2 for a write to a weakly held
// constant that protect() would pin nothing for (its protection does nothing: Note [Constants held weakly]
// in storage_table.py); 0 if the reference must take it (another constant, or first sight); -1 on error.
// Reads state only: track(x) then returns the same version.
int written_version(FastPath* f, PyObject* x, long* out) {
  long tv;
  int st;
  int live = live_version(f, x, &tv, &st);
  if (live <= 0) return live;
  int pinned = api->pinned(f->c, st);
  if (pinned < 0) return -1;
  if (pinned) {  // only a weakly held constant's (its protect targets are few: a strong one's walk the graph)
    Ref key(cached_int(st));
    PyObject* b = key ? PyDict_GetItemWithError(tget(f, T::phys), key.get()) : nullptr;
    if (b == nullptr) return PyErr_Occurred() || !key ? -1 : 0;
    PyObject* weak = slot_at(b, env.buf_weak);
    if (slot_at(b, env.buf_shared) != Py_True || weak == nullptr || weak == Py_None) return 0;
    int n = api->protect_targets(f->c, st, nullptr, 0);
    if (n != 0) return n < 0 ? -1 : 0;
  }
  *out = tv;
  return pinned ? 2 : 1;
}

// Liveness.release for an activation the program dropped.
bool release(FastPath* f, PyObject* h) {
  PyObject* alive = tget(f, T::alive);
  Ref t = borrowed(PyDict_GetItemWithError(alive, h));
  if (!t || PyDict_DelItem(alive, h) < 0) return false;
  PyObject* cdata_of = tget(f, T::cdata_of);
  Ref cdata = borrowed(PyDict_GetItemWithError(cdata_of, t.get()));
  if (cdata) {
    if (PyDict_DelItem(cdata_of, t.get()) < 0) return false;
    PyObject* version = tget(f, T::version);
    PyObject* cur = PyDict_GetItemWithError(version, cdata.get());
    if (cur != nullptr) {
      int eq = PyObject_RichCompareBool(cur, t.get(), Py_EQ);
      if (eq < 0 || (eq && PyDict_DelItem(version, cdata.get()) < 0)) return false;
    }
  }
  if (PyErr_Occurred()) return false;
  PyObject* recorder = mget(f, S::recorder);
  if (recorder != nullptr && recorder != Py_None) {
    Ref r(PyObject_CallMethodOneArg(recorder, names.release, h));
    if (!r) return false;
  }
  long tv = PyLong_AsLong(t.get());
  if (api->release(f->c, static_cast<int>(tv)) < 0) { translate_error(); return false; }
  int s = storage_of(f, tv);
  if (s < 0) return false;
  int res = api->resident(f->c, s);
  if (res < 0) return false;
  if (res) {
    int64_t refs = api->storage_refs(f->c, s);
    if (refs < 0) return false;
    if (refs == 0) {  // kept for an evicted dependent
      Ref key(cached_int(s));
      PyObject* b = PyDict_GetItemWithError(tget(f, T::phys), key.get());
      if (b == nullptr && PyErr_Occurred()) return false;
      if (b == nullptr || buf_gone(b)) {  // but its memory is gone: it must be recomputed
        if (api->forget(f->c, s) < 0) return false;
      }
    }
  }
  return true;
}

// Whether the handle's storage is dead (its buffer says so); -1 on error. Appends dead constants' info.
int handle_dead(FastPath* f, PyObject* alive, PyObject* phys, PyObject* h, bool* constant) {
  PyObject* t = PyDict_GetItemWithError(alive, h);
  if (t == nullptr) return PyErr_Occurred() ? -1 : 0;
  int s = storage_of(f, PyLong_AsLong(t));
  if (s < 0) return -1;
  PyObject* b = phys_of(f, phys, s);
  if (b == nullptr) return -1;
  int d = buf_dead(b);
  if (d <= 0) return d;
  int p = api->pinned(f->c, s);
  if (p < 0) return -1;
  *constant = *constant || p;
  return 1;
}

// What Liveness.poll(ops, handles) does with the dead handles ``dead`` of a partial poll when some are
// constants, if it can be done here: 1 done, 0 for the reference to do, -1 on error. Here means that no
// constant's protection would first release a dropped target or recompute (Note [Protecting in a partial
// poll] in liveness.py): for each dead constant, what protect() would pin is resident and alive, or the
// constant is worth keeping (Note [Keeping a dead constant]). Then, as the reference: the activations are
// released, and each constant not worth keeping (asked again: the releases can change it) is protected
// (and recorded so), then released. Pinned gradients end so: dropped by autograd or by the program's
// zero_grad(set_to_none=True) once their version chains were pinned.
int settle_constants(FastPath* f, PyObject* alive, PyObject* phys, const std::vector<PyObject*>& dead) {
  std::vector<int> targets;
  // worth_keeping(s) (0/1), filling `targets`; -1 on error.
  auto worth_keeping = [&](int s) -> int {
    int n = api->protect_targets(f->c, s, nullptr, 0);
    if (n < 0) return -1;
    targets.resize(static_cast<size_t>(n));
    if (n > 0 && api->protect_targets(f->c, s, targets.data(), n) != n) return -1;
    int64_t own = api->storage_size(f->c, s), sum = 0;
    if (own < 0) return -1;
    for (int d : targets) {
      int64_t z = api->storage_size(f->c, d);
      if (z < 0) return -1;
      sum += z;
    }
    return own < sum ? 1 : 0;
  };
  auto storage_of_handle = [&](PyObject* h) -> int {  // -2: not alive
    PyObject* t = PyDict_GetItemWithError(alive, h);
    if (t == nullptr) return PyErr_Occurred() ? -1 : -2;
    return storage_of(f, PyLong_AsLong(t));
  };
  std::vector<PyObject*> constants, activations;
  for (PyObject* h : dead) {
    int s = storage_of_handle(h);
    if (s < 0) return s == -2 ? 0 : -1;
    int p = api->pinned(f->c, s);
    if (p < 0) return -1;
    (p ? constants : activations).push_back(h);
    if (!p) continue;
    int w = worth_keeping(s);
    if (w < 0) return -1;
    if (w) continue;
    for (int d : targets) {  // the reference would release a dropped target first, or recompute: its case
      int r = api->resident(f->c, d);
      if (r < 0) return -1;
      Ref key(cached_int(d));
      PyObject* b = key ? PyDict_GetItemWithError(phys, key.get()) : nullptr;
      if (b == nullptr && PyErr_Occurred()) return -1;
      int gone = b == nullptr ? 1 : buf_dead(b);
      if (gone < 0) return -1;
      if (!r || gone) return 0;
    }
  }
  for (PyObject* h : activations)
    if (!release(f, h)) return -1;
  std::vector<PyObject*> protect;
  for (PyObject* h : constants) {
    int s = storage_of_handle(h);
    if (s == -2) continue;
    if (s < 0) return -1;
    int w = worth_keeping(s);
    if (w < 0) return -1;
    if (!w) protect.push_back(h);
  }
  PyObject* recorder = mget(f, S::recorder);
  for (PyObject* h : protect) {
    if (recorder != nullptr && recorder != Py_None) {
      Ref r(PyObject_CallMethodOneArg(recorder, names.protect, h));
      if (!r) return -1;
    }
    int s = storage_of_handle(h);
    if (s < 0) return -1;
    if (api->protect(f->c, s) < 0) { translate_error(); return -1; }
  }
  for (PyObject* h : protect)
    if (!release(f, h)) return -1;
  return 1;
}

// Liveness.poll(ops, handles) over the last ops' handles; what it cannot settle alone goes to the reference.
bool poll_recent(FastPath* f, PyObject* recent, Scratch& scratch) {
  // Each handle once, in order (the reference's dict.fromkeys). Equal handles are one object: each is made
  // once (StorageTable.new_handle) and only ever copied (mode.py's Note [Handles]).
  std::vector<PyObject*>& handles = scratch.handles;
  Py_ssize_t n = PyList_GET_SIZE(recent);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* hs = PyList_GET_ITEM(recent, i);
    Py_ssize_t m = PyList_GET_SIZE(hs);
    for (Py_ssize_t j = 0; j < m; ++j) {
      PyObject* h = PyList_GET_ITEM(hs, j);
      if (std::find(handles.begin(), handles.end(), h) == handles.end()) handles.push_back(h);
    }
  }
  PyObject* alive = tget(f, T::alive);
  PyObject* phys = tget(f, T::phys);
  std::vector<PyObject*>& dead = scratch.dead;
  bool constant = false;
  for (PyObject* h : handles) {
    int d = handle_dead(f, alive, phys, h, &constant);
    if (d < 0) return false;
    if (d) dead.push_back(h);
  }
  if (dead.empty()) return true;
  std::vector<Ref> keep_dead;  // (releasing deletes the handles from alive)
  for (PyObject* d : dead) keep_dead.push_back(borrowed(d));
  int settled = constant ? settle_constants(f, alive, phys, dead) : 0;
  if (settled < 0) return false;
  if (settled) return true;
  if (constant) {  // a dropped constant the reference decides on (Note [Keeping a dead constant])
    Ref list(PyList_New(static_cast<Py_ssize_t>(handles.size())));
    if (!list) return false;
    for (size_t i = 0; i < handles.size(); ++i) {
      Py_INCREF(handles[i]);
      PyList_SET_ITEM(list.get(), i, handles[i]);
    }
    Ref r(PyObject_CallMethodOneArg(f->mode, names.poll, list.get()));
    return static_cast<bool>(r);
  }
  std::vector<Ref> keep;  // (releasing drops the recent lists' references? no: but the handles may go)
  for (PyObject* d : dead) keep.push_back(borrowed(d));
  for (PyObject* d : dead)
    if (!release(f, d)) return false;
  return true;
}

// Liveness.poll(ops): the scheduled full poll, over every live handle. As in poll_recent, dead activations are
// released here; a dead constant sends the whole poll to the reference (it protects, keeps or releases).
bool poll_full(FastPath* f, Scratch& scratch) {
  Ref r(PyObject_CallMethodOneArg(f->liveness, names.schedule, mget(f, S::ops_seen)));
  if (!r) return false;
  PyObject* alive = tget(f, T::alive);
  PyObject* phys = tget(f, T::phys);
  std::vector<PyObject*>& dead = scratch.dead;  // borrowed from alive until the releases start
  Py_ssize_t pos = 0;
  PyObject *h, *t;
  bool constant = false;
  while (PyDict_Next(alive, &pos, &h, &t)) {
    int s = storage_of(f, PyLong_AsLong(t));
    if (s < 0) return false;
    PyObject* b = phys_of(f, phys, s);
    if (b == nullptr) return false;
    int d = buf_dead(b);
    if (d < 0) return false;
    if (!d) continue;
    int p = api->pinned(f->c, s);
    if (p < 0) return false;
    if (p) { constant = true; break; }
    dead.push_back(h);
  }
  if (constant) {
    Ref r2(PyObject_CallMethodNoArgs(f->mode, names.poll));
    return static_cast<bool>(r2);
  }
  std::vector<Ref> keep;  // releasing deletes the handles from alive
  keep.reserve(dead.size());
  for (PyObject* d : dead) keep.push_back(borrowed(d));
  for (PyObject* d : dead)
    if (!release(f, d)) return false;
  return true;
}

bool hold_weak_constant(PyObject* phys, int s) {
  Ref key(cached_int(s));
  PyObject* b = key ? PyDict_GetItemWithError(phys, key.get()) : nullptr;
  if (b == nullptr) return !PyErr_Occurred() && key;
  PyObject* shared = slot_at(b, env.buf_shared);
  PyObject* weak = slot_at(b, env.buf_weak);
  if (shared != Py_True || weak == nullptr || weak == Py_None) return true;
  return hold_strongly(phys, key.get(), weak);
}

PyObject* new_handle(FastPath* f) {  // StorageTable.new_handle (mode.py's Note [Handles])
  PyObject*& slot = slot_at(f->table, table_slots[static_cast<int>(T::_next_handle)]);
  long n = PyLong_AsLong(slot) + 1;
  if (n <= 0) return nullptr;
  PyObject* o = cached_int(n);
  if (o == nullptr) return nullptr;
  Py_INCREF(o);
  Py_SETREF(slot, o);
  return o;
}

// A Slot(tensor, offset, size, stride, dtype) (a NamedTuple: a tuple of its class).
PyObject* new_slot(long t, int64_t offset, PyObject* size, PyObject* stride, PyObject* dtype) {
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(env.slot_type);
  PyObject* s = type->tp_alloc(type, 5);
  if (s == nullptr) return nullptr;
  PyObject* a = cached_int(t);
  PyObject* b = PyLong_FromLongLong(offset);
  if (a == nullptr || b == nullptr) { Py_XDECREF(a); Py_XDECREF(b); Py_DECREF(s); return nullptr; }
  Py_INCREF(size); Py_INCREF(stride); Py_INCREF(dtype);
  PyTuple_SET_ITEM(s, 0, a); PyTuple_SET_ITEM(s, 1, b); PyTuple_SET_ITEM(s, 2, size);
  PyTuple_SET_ITEM(s, 3, stride); PyTuple_SET_ITEM(s, 4, dtype);
  untrack(s);  // see Note [Untracked records]
  return s;
}

PyObject* int_tuple(c10::IntArrayRef v) {
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


void flatten_out(PyObject* x, std::vector<PyObject*>& out) {  // mode.tree_flatten of a result
  if (PyTuple_Check(x) || PyList_Check(x)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
    PyObject** items = PySequence_Fast_ITEMS(x);
    for (Py_ssize_t i = 0; i < n; ++i) flatten_out(items[i], out);
    return;
  }
  out.push_back(x);
}

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

// The signature's entry: on first sight, the reference predicts (DTRMode._native_predict).
Entry* entry_for(FastPath* f, PyObject* func, PyObject* args, PyObject* kwargs, Scan& s) {
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

// The dispatch key the entry takes (Note [The dispatch-key entry]).
constexpr c10::DispatchKey kEntryKey = c10::DispatchKey::Fake;

// An op that arrived through the dispatch key (Note [The dispatch-key entry]): where it is on the stack.
struct KeyCall {
  const c10::OperatorHandle* op;
  c10::DispatchKeySet ks;
  torch::jit::Stack* stack;
  size_t n_args;
};

// The reference's result in place of the op's arguments on the stack (what torch's Python fallback does).
void push_result(const KeyCall& kc, PyObject* r) {
  const auto& returns = kc.op->schema().returns();
  torch::jit::drop(*kc.stack, kc.n_args);
  if (returns.empty()) return;
  if (returns.size() == 1) {
    kc.stack->push_back(torch::jit::toIValue(r, returns[0].real_type()));
    return;
  }
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != static_cast<Py_ssize_t>(returns.size()))
    throw std::runtime_error("dtr internal error: the reference returned the wrong number of outputs");
  for (size_t i = 0; i < returns.size(); ++i)
    kc.stack->push_back(torch::jit::toIValue(PyTuple_GET_ITEM(r, i), returns[i].real_type()));
}

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

// Everything after the op ran (DTRMode._commit for an op that writes nothing).
// (ops_seen: the mode's ops_seen, which nothing changes while an op runs.)
PyObject* commit(FastPath* f, PyObject* func, const OpInfo* info, Entry* e, Scratch& scratch, long op, PyObject* out,
                 double cost, PyObject* rng, long ops_seen, long written, bool to_constant) {
  Scan& s = scratch.scan;
  const std::vector<long>& ins = scratch.ins;
  Ref out_ref = borrowed(out);
  auto output_at = [&scratch](int pos) -> const at::Tensor* {  // flattened output pos, if a tensor
    if (scratch.outs_on_stack)
      return pos < static_cast<int>(scratch.touts.size()) && scratch.touts[pos].defined() ? &scratch.touts[pos]
                                                                                           : nullptr;
    PyObject* o = pos < static_cast<int>(scratch.flat.size()) ? scratch.flat[pos] : nullptr;
    return o != nullptr && THPVariable_Check(o) ? &THPVariable_Unpack(o) : nullptr;
  };
  std::vector<int>& outs = scratch.outs;
  // written: the version an in-place op wrote; a new version follows it unless it is a constant's.
  long new_written = to_constant ? -1 : written;
  outs.assign(e->sizes.size() + 1 + (new_written >= 0), -1);
  int n_outs = api->op_outputs(f->c, static_cast<int>(op), outs.data(), static_cast<int>(outs.size()));
  if (n_outs < 0) return nullptr;
  std::vector<long>& new_tensors = scratch.new_tensors;
  for (size_t k = 0; k < e->sizes.size(); ++k) new_tensors.push_back(outs[k]);
  PyObject* version = tget(f, T::version);
  PyObject* cdata_of = tget(f, T::cdata_of);
  PyObject* phys = tget(f, T::phys);
  PyObject* handle = tget(f, T::handle);
  PyObject* alive = tget(f, T::alive);
  Ref out_slots(PyTuple_New(static_cast<Py_ssize_t>(e->owning.size())));
  if (!out_slots) return nullptr;
  std::vector<Ref> out_handles;  // (the new tensors' handles, in order)
  out_handles.reserve(e->owning.size());
  for (size_t k = 0; k < e->owning.size(); ++k) {
    int pos = e->owning[k];
    const at::Tensor* otp = output_at(pos);
    if (otp == nullptr) {
      PyErr_Format(PyExc_RuntimeError, "dtr internal error: output %d of %R is not a tensor; please report this",
                   pos, func);
      return nullptr;
    }
    const at::Tensor& ot = *otp;
    if (!ot.has_storage()) {
      PyErr_Format(PyExc_RuntimeError, "dtr: output %d of %R has no storage; run with DTR_NATIVE=0 and please "
                   "report this", pos, func);
      return nullptr;
    }
    c10::StorageImpl* impl = ot.storage().unsafeGetStorageImpl();
    if (static_cast<int64_t>(impl->nbytes()) != e->sizes[k]) {
      Ref got(PyLong_FromSize_t(impl->nbytes())), want(PyLong_FromLongLong(e->sizes[k]));
      PyObject* a[3] = {func, got.get(), want.get()};
      Ref w(PyObject_Vectorcall(env.size_warning, a, 3, nullptr));
      if (!w) return nullptr;
    }
    long t = new_tensors[k];
    Ref cdata(PyLong_FromVoidPtr(impl)), tk(cached_int(t));
    int st = storage_of(f, t);
    if (!cdata || !tk || st < 0) return nullptr;
    Ref sk(cached_int(st));
    Ref buf(new_weak_buf(impl));
    Ref h(new_handle(f));
    if (!sk || !buf || !h) return nullptr;
    if (PyDict_SetItem(version, cdata.get(), tk.get()) < 0 || PyDict_SetItem(cdata_of, tk.get(), cdata.get()) < 0 ||
        PyDict_SetItem(phys, sk.get(), buf.get()) < 0 || PyDict_SetItem(handle, tk.get(), h.get()) < 0 ||
        PyDict_SetItem(alive, h.get(), tk.get()) < 0)
      return nullptr;
    out_handles.push_back(borrowed(h.get()));
    Ref size(e->out_layout(k, 0, ot.sizes())), stride(e->out_layout(k, 1, ot.strides()));
    if (!size || !stride) return nullptr;
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(ot.scalar_type()));
    Ref slot(new_slot(t, ot.storage_offset(), size.get(), stride.get(), dtype));
    Ref p(PyLong_FromLong(pos));
    if (!slot || !p) return nullptr;
    PyObject* pair = PyTuple_Pack(2, p.get(), slot.get());
    if (pair == nullptr) return nullptr;
    untrack(pair);
    PyTuple_SET_ITEM(out_slots.get(), k, pair);
  }
  long new_version = -1;  // an in-place op's: the written storage's new version (mode.py _commit's writes)
  Ref written_handle;
  if (written >= 0 && to_constant) {  // (const_writes: the constant keeps its version and buffer)
    Ref k(cached_int(written));
    PyObject* h = k ? PyDict_GetItemWithError(handle, k.get()) : nullptr;
    if (h == nullptr) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%ld", written);
      return nullptr;
    }
    written_handle = borrowed(h);
  } else if (written >= 0) {
    new_version = outs[e->sizes.size()];
    const at::Tensor& wt = THPVariable_Unpack(s.leaves[0].obj);
    c10::StorageImpl* impl = wt.storage().unsafeGetStorageImpl();
    int old_st = storage_of(f, written), new_st = storage_of(f, new_version);
    if (old_st < 0 || new_st < 0) return nullptr;
    // The old version loses its buffer to the new one (recompute.py's Note [Versions]).
    Ref empty(new_empty_owned_buf(wt.device())), buf(new_weak_buf(impl));
    Ref old_sk(cached_int(old_st)), new_sk(cached_int(new_st)), cdata(PyLong_FromVoidPtr(impl));
    Ref old_k(cached_int(written)), new_k(cached_int(new_version));
    if (!empty || !buf || !old_sk || !new_sk || !cdata || !old_k || !new_k) return nullptr;
    if (PyDict_SetItem(phys, old_sk.get(), empty.get()) < 0 || PyDict_SetItem(phys, new_sk.get(), buf.get()) < 0 ||
        PyDict_SetItem(version, cdata.get(), new_k.get()) < 0)
      return nullptr;
    if (PyDict_Pop(cdata_of, old_k.get(), nullptr) < 0 || PyDict_SetItem(cdata_of, new_k.get(), cdata.get()) < 0)
      return nullptr;
    PyObject* h = PyDict_GetItemWithError(handle, old_k.get());
    if (h == nullptr) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%ld", written);
      return nullptr;
    }
    written_handle = borrowed(h);
    if (PyDict_SetItem(handle, new_k.get(), h) < 0) return nullptr;
    int in_alive = PyDict_Contains(alive, h);
    if (in_alive < 0 || (in_alive && PyDict_SetItem(alive, h, new_k.get()) < 0)) return nullptr;
  }
  if (!e->owning.empty() || new_written >= 0) {  // computed from its inputs: see Note [Constants held weakly]
    for (long t : ins) {
      int st = storage_of(f, t);
      int pinned = st < 0 ? -1 : api->pinned(f->c, st);
      if (pinned < 0) return nullptr;
      if (pinned && !hold_weak_constant(phys, st)) return nullptr;
    }
  }
  auto handles_of = [&](const std::vector<long>& ts, bool skip_missing) -> Ref {
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
  };
  PyObject* recorder = mget(f, S::recorder);
  if (recorder != nullptr && recorder != Py_None) {
    Ref sizes_list(PyList_New(static_cast<Py_ssize_t>(e->sizes.size())));
    Ref cost_obj(PyFloat_FromDouble(cost));
    if (!sizes_list || !cost_obj) return nullptr;
    for (size_t k = 0; k < e->sizes.size(); ++k) {
      PyObject* x = PyLong_FromLongLong(e->sizes[k]);
      if (x == nullptr) return nullptr;
      PyList_SET_ITEM(sizes_list.get(), k, x);
    }
    Ref in_h = handles_of(ins, false), out_h = handles_of(new_tensors, false);  // (rare: a log is recorded)
    Ref mutated(PyList_New(0));
    if (mutated && written_handle && PyList_Append(mutated.get(), written_handle.get()) < 0) return nullptr;
    Ref kw(PyDict_New());
    if (!in_h || !out_h || !mutated || !kw || PyDict_SetItem(kw.get(), names.mutated, mutated.get()) < 0)
      return nullptr;
    Ref meth(PyObject_GetAttr(recorder, names.call));
    Ref a(PyTuple_Pack(5, info->name.get(), in_h.get(), out_h.get(), sizes_list.get(), cost_obj.get()));
    if (!meth || !a) return nullptr;
    Ref r(PyObject_Call(meth.get(), a.get(), kw.get()));
    if (!r) return nullptr;
  }
  if (api->end_call(f->c, static_cast<int>(op), cost) < 0) { translate_error(); return nullptr; }
  {  // the handles this op read and made, for the next ops' polls
    Ref hs = handles_of(ins, true);
    if (!hs) return nullptr;
    for (const Ref& h : out_handles)
      if (PyList_Append(hs.get(), h.get()) < 0) return nullptr;
    PyObject* recent = lget(f, L::recent);  // (Liveness.saw)
    if (!PyList_CheckExact(recent)) {
      PyErr_SetString(PyExc_TypeError, "dtr internal error: the liveness's recent is not a list; please report this");
      return nullptr;
    }
    Py_ssize_t n = PyList_GET_SIZE(recent);
    if (n > 0 && n == env.recent_ops) {  // full: drop the oldest and append, in place (the reference's append, del [0])
      PyObject** items = reinterpret_cast<PyListObject*>(recent)->ob_item;
      PyObject* oldest = items[0];
      for (Py_ssize_t i = 1; i < n; ++i) items[i - 1] = items[i];
      items[n - 1] = hs.release();
      Py_DECREF(oldest);
    } else if (PyList_Append(recent, hs.get()) < 0 ||
               (PyList_GET_SIZE(recent) > env.recent_ops && PySequence_DelItem(recent, 0) < 0)) {
      return nullptr;
    }
  }
  if (!e->owning.empty() || written >= 0) {  // the recipe (ops that produce nothing are never recomputed)
    Ref rleaves(PyTuple_New(static_cast<Py_ssize_t>(s.leaves.size())));
    if (!rleaves) return nullptr;
    size_t k = 0;
    for (size_t i = 0; i < s.leaves.size(); ++i) {
      PyObject* x = s.leaves[i].obj;
      if (s.leaves[i].tensor) {
        const at::Tensor& t = THPVariable_Unpack(x);
        PyObject* slot;
        if (written < 0) {  // (an op that writes nothing leaves its inputs' layouts as the signature's)
          slot = new_slot(ins[k], t.storage_offset(), e->lay_size[k].get(), e->lay_stride[k].get(),
                          e->lay_dtype[k].get());
        } else {  // (layouts as they are now, as the reference reads them after an op that writes)
          Ref size(e->out_layout_or(e->lay_size[k].get(), t.sizes())), stride(e->out_layout_or(e->lay_stride[k].get(),
                                                                                                t.strides()));
          PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
          slot = size && stride ? new_slot(ins[k], t.storage_offset(), size.get(), stride.get(), dtype) : nullptr;
        }
        if (slot == nullptr) return nullptr;
        PyTuple_SET_ITEM(rleaves.get(), i, slot);
        ++k;
      } else {
        Py_INCREF(x);
        PyTuple_SET_ITEM(rleaves.get(), i, x);
      }
    }
    PyTypeObject* rt = reinterpret_cast<PyTypeObject*>(env.recipe_type);
    PyObject* recipe = rt->tp_alloc(rt, 6);
    if (recipe == nullptr) return nullptr;
    Ref rec(recipe);
    Ref empty(PyTuple_New(0));
    if (!empty) return nullptr;
    Py_INCREF(func); PyTuple_SET_ITEM(recipe, 0, func);
    PyTuple_SET_ITEM(recipe, 1, rleaves.release());
    Py_INCREF(e->spec.get()); PyTuple_SET_ITEM(recipe, 2, e->spec.get());
    PyTuple_SET_ITEM(recipe, 3, out_slots.release());
    if (written >= 0) {  // ((leaf position, old version, new version or -1 for a constant),)
      Ref w(Py_BuildValue("((iii))", 0, static_cast<int>(written), static_cast<int>(new_version)));
      if (!w) return nullptr;
      untrack(w.get());
      untrack(PyTuple_GET_ITEM(w.get(), 0));
      empty = std::move(w);
    }
    PyTuple_SET_ITEM(recipe, 4, empty.release());
    Py_INCREF(rng); PyTuple_SET_ITEM(recipe, 5, rng);
    untrack(recipe);  // (and its leaves and outputs: see Note [Untracked records])
    untrack(PyTuple_GET_ITEM(recipe, 1));
    untrack(PyTuple_GET_ITEM(recipe, 3));
    Ref opk(cached_int(op));
    if (!opk || PyDict_SetItem(recipes_of(f), opk.get(), recipe) < 0) return nullptr;
  }
  if (new_written >= 0) {  // version chains (mode.py's Note [Version chains]): pinned at _MAX_VERSIONS
    PyObject* versions = tget(f, T::versions);  // (StorageTable.write's count)
    Ref old_k(cached_int(written)), new_k(cached_int(new_version));
    if (!old_k || !new_k) return nullptr;
    Ref prev(PyObject_CallMethod(versions, "pop", "OO", old_k.get(), Py_False));
    if (!prev) return nullptr;
    long n = PyLong_AsLong(prev.get()) + 1;
    Ref nk(PyLong_FromLong(n));
    if (!nk || PyDict_SetItem(versions, new_k.get(), nk.get()) < 0) return nullptr;
    if (n >= env.max_versions) {
      if (recorder != nullptr && recorder != Py_None) {
        PyObject* h = PyDict_GetItemWithError(handle, new_k.get());
        if (h == nullptr) return nullptr;
        Ref r(PyObject_CallMethodOneArg(recorder, names.pin, h));
        if (!r) return nullptr;
      }
      Ref why(PyLong_FromLong(3));  // dtr._C.Hold.VERSION_CHAIN (csrc/core.h): why it is pinned
      Ref r(why ? PyObject_CallMethodObjArgs(f->core, names.pin, new_k.get(), why.get(), nullptr) : nullptr);
      if (!r) return nullptr;
    }
  }
  if (ops_seen - mget_long(f, S::_ops_at_gc) > std::max(env.gc_min_ops, mget_long(f, S::_live_after_gc))) {
    Ref r(PyObject_CallMethodNoArgs(f->mode, names.collect));
    if (!r) return nullptr;
  }
  return out_ref.release();
}

// The leaf of x that DTRMode._trackable meets first (a strided tensor, neither nested nor meta): 1 with *first
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
    if (t.defined() && t.layout() == c10::kStrided && !t.is_nested() && !t.is_meta() &&
        !t.key_set().has(c10::DispatchKey::Python)) {  // (DTRMode._trackable)
      *first = x;
      return 1;
    }
  }
  return 0;
}

// The block's first op with a trackable tensor sets the device (DTRMode._set_device, as the reference's
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

PyObject* fast_call_op(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                       const KeyCall* kc) {
  if (kwargs == Py_None || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) == 0)) kwargs = nullptr;
  if (PyTuple_Check(types)) {  // a tensor subclass's op: the reference declines it (mode.py's Note [Tensor
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); ++i)  // subclasses]; torch.Tensor itself may be named)
      if (PyTuple_GET_ITEM(types, i) != THPVariableClass) return run_fallback(f, func, types, args, kwargs, kc);
  }
  PyObject* device_type = mget(f, S::device_type);
  if (device_type == Py_None && PyTuple_Check(args)) {
    if (!set_device_from(f, args, kwargs)) return nullptr;
    device_type = mget(f, S::device_type);
  }
  // Whether this op may take the path at all (nothing here changes any state).
  PyObject* opaque = mget(f, S::_opaque_readers);
  PyObject* timer = mget(f, S::timer);
  if (device_type == nullptr || device_type == Py_None || !PyUnicode_Check(device_type) ||
      (opaque != nullptr && PyDict_Check(opaque) && PyDict_GET_SIZE(opaque) > 0) || timer == nullptr ||
      (f->measured && reinterpret_cast<PyObject*>(Py_TYPE(timer)) != env.wall_timer) || !PyTuple_Check(args)) {
    if (PyErr_Occurred()) return nullptr;
    return run_fallback(f, func, types, args, kwargs, kc);
  }
  if (device_type != f->device_name) {
    const char* name = PyUnicode_AsUTF8(device_type);
    if (name == nullptr) return nullptr;
    try {
      f->device = c10::Device(std::string(name)).type();
    } catch (const std::exception&) {
      return run_fallback(f, func, types, args, kwargs, kc);
    }
    Py_INCREF(device_type);
    Py_XSETREF(f->device_name, device_type);
  }
  const OpInfo* info = op_info(func);
  if (info == nullptr) return nullptr;
  if ((!info->fast && !info->inplace) || (kc != nullptr && f->key_reference))
    return run_fallback(f, func, types, args, kwargs, kc);
  dtr::DepthLease<Scratch> lease;
  Scratch& scratch = *lease;
  scratch.clear();
  Scan& s = scratch.scan;
  s.device = f->device;
  if (!scan_args(func, args, kwargs, s) || s.tpos.empty()) {
    if (PyErr_Occurred()) return nullptr;
    return run_fallback(f, func, types, args, kwargs, kc);
  }
  Entry* e = entry_for(f, func, args, kwargs, s);
  if (e == nullptr) return nullptr;
  if (!e->ok) return run_fallback(f, func, types, args, kwargs, kc);
  long written = -1;  // the version an in-place op writes (its first argument's), or -1
  bool to_constant = false;  // and whether it is a constant's (no new version)
  if (info->inplace) {
    if (!e->sizes.empty() || s.tpos[0] != 0 || !s.leaves[0].tensor) return run_fallback(f, func, types, args, kwargs, kc);
    int w = written_version(f, s.leaves[0].obj, &written);
    if (w < 0) return nullptr;
    if (w == 0) return run_fallback(f, func, types, args, kwargs, kc);
    to_constant = w == 2;
  }
  f->native_ops++;

  // From here on, the reference's __torch_dispatch__ step by step.
  long ops_seen = mget_long(f, S::ops_seen) + 1;
  if (ops_seen <= 0 || !mset_long(f, S::ops_seen, ops_seen)) return nullptr;
  std::vector<long>& ins = scratch.ins;
  for (int p : s.tpos) {
    long t = track(f, s.leaves[p].obj);
    if (t < 0) return nullptr;
    ins.push_back(t);
  }
  int64_t need = api->memory(f->c) + e->total;
  int64_t budget = api->budget(f->c);
  bool full = false;
  if (ops_seen >= PyLong_AsLong(lget(f, L::next_full_poll))) {  // Liveness.due
    PyObject* on_schedule = lget(f, L::on_schedule);
    if (on_schedule == Py_True) {
      full = true;
    } else {
      full = need > api->peak_memory(f->c);
    }
  }
  full = full || (budget >= 0 && need > budget);
  if (!full) {
    for (long t : ins) {  // a recomputation must not read a storage just dropped
      int d = api->defined(f->c, static_cast<int>(t));
      if (d < 0) return nullptr;
      if (!d) { full = true; break; }
    }
  }
  if (full) {
    if (!poll_full(f, scratch)) return nullptr;
  } else {
    PyObject* recent = lget(f, L::recent);
    if (PyList_GET_SIZE(recent) > 0 && !poll_recent(f, recent, scratch)) return nullptr;
  }
  if (PyErr_Occurred()) return nullptr;
  Ref rng = borrowed(Py_None);
  if (info->seeded) {
    Ref leaves(PyList_New(static_cast<Py_ssize_t>(s.leaves.size())));
    if (!leaves) return nullptr;
    for (size_t i = 0; i < s.leaves.size(); ++i) {
      Py_INCREF(s.leaves[i].obj);
      PyList_SET_ITEM(leaves.get(), i, s.leaves[i].obj);
    }
    Ref device(PyObject_GetAttr(s.leaves[s.tpos[0]].obj, names.device));
    if (!device) return nullptr;
    PyObject* a[3] = {func, leaves.get(), device.get()};
    rng = Ref(PyObject_Vectorcall(env.rng_capture, a, 3, nullptr));
    if (!rng) return nullptr;
  }
  double cost = 0.0;  // a view computes nothing
  if (!f->measured && (!e->sizes.empty() || written >= 0)) {
    if (e->flops < 0 || e->flops_model.get() != f->cost_model) {
      Ref kw = kwargs ? borrowed(kwargs) : Ref(PyDict_New());
      Ref r(kw ? PyObject_CallMethodObjArgs(f->cost_model, names.estimate, func, args, kw.get(), e->metas.get(),
                                            nullptr)
               : nullptr);
      if (!r) return nullptr;
      e->flops = PyFloat_AsDouble(r.get());
      if (PyErr_Occurred()) return nullptr;
      e->flops_model = borrowed(f->cost_model);
    }
    cost = e->flops;
  }
  std::vector<int>& in_ids = scratch.in_ids;
  in_ids.assign(ins.begin(), ins.end());
  int op;
  if (written < 0 || to_constant) {  // (a write to a constant makes no new version: mode.py's const_writes)
    op = api->begin_call(f->c, in_ids.data(), static_cast<int>(in_ids.size()), e->sizes.data(),
                         static_cast<int>(e->sizes.size()), cost);
  } else {  // the new version of the written input last, sized as its storage (mode.py: inplace_of)
    if (ins[0] != written) {
      PyErr_SetString(PyExc_RuntimeError, "dtr internal error: a written version changed as it was tracked");
      return nullptr;
    }
    int st = storage_of(f, written);
    int64_t size = st < 0 ? -1 : api->storage_size(f->c, st);
    if (size < 0) return nullptr;
    std::vector<int64_t>& all_sizes = scratch.all_sizes;
    std::vector<int>& inplace_of = scratch.inplace_of;
    all_sizes.assign(e->sizes.begin(), e->sizes.end());
    all_sizes.push_back(size);
    inplace_of.assign(e->sizes.size(), -1);
    inplace_of.push_back(0);  // (ins.index(written): the first argument is the first tensor)
    op = api->begin_call_inplace(f->c, in_ids.data(), static_cast<int>(in_ids.size()), all_sizes.data(),
                                 inplace_of.data(), static_cast<int>(all_sizes.size()), cost);
  }
  if (op < 0) { translate_error(); return nullptr; }
  // The op itself, timed on the host clock (timing.WallTimer: perf_counter_ns) when costs are measured.
  auto t0 = std::chrono::steady_clock::now();
  PyObject* out;
  std::vector<at::Tensor>& touts = scratch.touts;
  struct Release {  // (the scratch outlives the op: holding its outputs would keep them alive)
    std::vector<at::Tensor>& v;
    ~Release() { v.clear(); }
  } release_outputs{touts};
  if (kc != nullptr) {  // the op's own arguments, run below this key (Note [The dispatch-key entry])
    try {
      kc->op->redispatchBoxed(kc->ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kEntryKey), kc->stack);
    } catch (...) {
      if (api->abort_call(f->c, op) < 0) PyErr_Clear();  // (the op's own error is the one the program sees)
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
    scratch.outs_on_stack = true;
    Py_INCREF(Py_None);
    out = Py_None;
  } else {
    out = PyObject_Call(info->call.get(), args, kwargs);
    if (out == nullptr) {
      PyObject *et, *ev, *etb;
      PyErr_Fetch(&et, &ev, &etb);
      if (api->abort_call(f->c, op) < 0) PyErr_Clear();  // (the op's own error is the one the program sees)
      PyErr_Restore(et, ev, etb);
      return nullptr;
    }
    std::vector<PyObject*>& flat = scratch.flat;
    flatten_out(out, flat);

  }
  auto t1 = std::chrono::steady_clock::now();
  if (f->measured) cost = static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
  PyObject* result = commit(f, func, info, e, scratch, op, out, cost, rng.get(), ops_seen, written, to_constant);
  Py_DECREF(out);
  return result;
}

// fast_call_op, naming the op in a budget error that leaves it (dtr/runtime/failures.py: the core reports ids).
PyObject* fast_call(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                    const KeyCall* kc) {
  PyObject* r = fast_call_op(f, func, types, args, kwargs, kc);
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


// ---------------------------------------------------------- the dispatch key
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
// (fast_call), except that the op itself runs on the original stack below
// the key and its outputs are read from there, never converted back.
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

void key_entry(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // dtr's own work and the op's are below this key and outside autograd (see the Note above)
  c10::impl::ExcludeDispatchKeyGuard off(c10::DispatchKeySet(c10::DispatchKeySet::FULL) ^
                                         c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kEntryKey));
  pybind11::gil_scoped_acquire gil;
  FastPath* f = key_owner;
  if (f == nullptr) {  // (no block owns the key: pass the op on)
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kEntryKey), stack);
    return;
  }
  const auto& schema_args = op.schema().arguments();
  size_t n = schema_args.size();
  auto in = torch::jit::last(*stack, n);
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
    if (types) r = fast_call(f, func, types.get(), args.get(), kwargs.get(), &kc);  // (C++ errors pass through)
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

// ------------------------------------------------------------ the Python type
// No C++ exception may cross into Python (torch's accessors throw c10::Error): one barrier for both entries.
PyObject* guarded_call(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs) {
  try {
    return fast_call(f, func, types, args, kwargs, nullptr);
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
    PyErr_SetString(PyExc_TypeError, "FastPath(mode, ...): mode must be a DTRMode");
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
  api->set_compute_hook_first(f->c, 0);  // (DTRMode._on_compute has nothing to do for a first computation)
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

// The core's on_evict hook while this path runs (a C function: Note [The core's C route]). DTRMode._on_evict
// has nothing to do for a storage that nothing references and whose buffer is gone (the program dropped it
// and the core freed it) or holds no bytes (an old version's, once a write took its buffer: collection frees
// those), so those cases end here; any other goes to the reference. 0, or -1 with a Python exception set.
int on_evict(FastPath* f, int s) {
  Ref key(cached_int(s));
  if (!key) return -1;
  PyObject* b = PyDict_GetItemWithError(tget(f, T::phys), key.get());
  if (b == nullptr && PyErr_Occurred()) return -1;
  c10::StorageImpl* impl = b == nullptr ? nullptr : buf_impl(b);
  if (impl == nullptr || impl->nbytes() == 0) {  // (resizing it to 0 bytes would change nothing)
    int64_t refs = api->storage_refs(f->c, s);
    if (refs < 0) return -1;
    if (refs == 0) return 0;
  }
  Ref r(PyObject_CallMethodOneArg(f->mode, names._on_evict, key.get()));
  return r ? 0 : -1;
}

int on_evict_hook(void* ctx, int s, int /*by_heuristic*/) {
  try {
    return on_evict(reinterpret_cast<FastPath*>(ctx), s);
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

// The core's on_compute hook (op, remat) while this path runs: DTRMode._on_compute has work only for a
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

// DTRMode._constant(storage), the reference's steps: a storage from before the block becomes a constant.
PyObject* constant(FastPath* f, PyObject* st) {
  if (!THPStorage_Check(st)) {
    PyErr_SetString(PyExc_TypeError, "constant(storage): not a storage");
    return nullptr;
  }
  c10::StorageImpl* impl = THPStorage_Unpack(st).unsafeGetStorageImpl();
  int64_t nbytes = static_cast<int64_t>(impl->nbytes());
  int t = api->constant(f->c, nbytes);
  if (t < 0) { translate_error(); return nullptr; }
  int s = storage_of(f, t);
  if (s < 0) return nullptr;
  Ref cdata(PyLong_FromVoidPtr(impl)), tk(cached_int(t)), sk(cached_int(s));
  Ref buf(new_shared_buf(st));
  if (!cdata || !tk || !sk || !buf) return nullptr;
  if (PyDict_SetItem(tget(f, T::version), cdata.get(), tk.get()) < 0 ||
      PyDict_SetItem(tget(f, T::cdata_of), tk.get(), cdata.get()) < 0 ||
      PyDict_SetItem(tget(f, T::phys), sk.get(), buf.get()) < 0)
    return nullptr;
  Ref h(new_handle(f));
  if (!h || PyDict_SetItem(tget(f, T::handle), tk.get(), h.get()) < 0 ||
      PyDict_SetItem(tget(f, T::alive), h.get(), tk.get()) < 0)
    return nullptr;
  PyObject* recorder = mget(f, S::recorder);
  if (recorder != nullptr && recorder != Py_None) {
    Ref n(PyLong_FromLongLong(nbytes));
    if (!n) return nullptr;
    Ref r(PyObject_CallMethodObjArgs(recorder, names.constant, h.get(), n.get(), nullptr));
    if (!r) return nullptr;
  }
  return tk.release();
}

PyObject* FastPath_constant(PyObject* self, PyObject* st) {
  try {
    return constant(reinterpret_cast<FastPath*>(self), st);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr native per-op path: %s", e.what());
    return nullptr;
  }
}

// DTRMode._carried(): each resident storage the program still holds, once, in a buffer holding it weakly.
PyObject* FastPath_carried(PyObject* self, PyObject*) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  PyObject* alive = tget(f, T::alive);
  PyObject* phys = tget(f, T::phys);
  if (alive == nullptr || phys == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "the mode has no alive/phys tables");
    return nullptr;
  }
  Ref out(PyList_New(0));
  if (!out) return nullptr;
  std::vector<c10::StorageImpl*> seen;  // (sorted: each storage once)
  Py_ssize_t pos = 0;
  PyObject *h, *t;
  while (PyDict_Next(alive, &pos, &h, &t)) {
    int s = storage_of(f, PyLong_AsLong(t));
    if (s < 0) return nullptr;
    Ref key(cached_int(s));
    if (!key) return nullptr;
    PyObject* b = PyDict_GetItemWithError(phys, key.get());
    if (b == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      continue;
    }
    PyObject* dropped = slot_at(b, env.buf_dropped);
    int d = dropped ? PyObject_IsTrue(dropped) : 0;
    if (d < 0) return nullptr;
    c10::StorageImpl* impl = d ? nullptr : buf_impl(b);
    if (impl == nullptr || impl->nbytes() == 0) continue;
    auto at = std::lower_bound(seen.begin(), seen.end(), impl);
    if (at != seen.end() && *at == impl) continue;
    seen.insert(at, impl);
    Ref w(new_weak_buf(impl));
    if (!w || PyList_Append(out.get(), w.get()) < 0) return nullptr;
  }
  return out.release();
}

// The core's on_pin hook (storage) while this path runs: DTRMode._on_pin's steps (StorageTable.pinned). A
// constant must outlive the program's references once something computed from it may need its value: its
// buffer is then held strongly, else weakly as a constant's (Note [Constants held weakly]).
PyObject* FastPath_on_pin(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  FastPath* f = reinterpret_cast<FastPath*>(self);
  if (n < 1 || !PyLong_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "on_pin(storage)");
    return nullptr;
  }
  long s = PyLong_AsLong(args[0]);
  int deps = api->dependents(f->c, static_cast<int>(s));
  int64_t size = deps < 0 ? -1 : api->storage_size(f->c, static_cast<int>(s));
  if (size < 0) return nullptr;
  PyObject* phys = tget(f, T::phys);
  PyObject* b = phys ? PyDict_GetItemWithError(phys, args[0]) : nullptr;
  if (b == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  PyObject* weak = slot_at(b, env.buf_weak);
  if (weak == nullptr || weak == Py_None) Py_RETURN_NONE;
  if (deps > 0 || size == 0) {  // (StorageTable.pinned's ``strongly``, as DTRMode._on_pin decides it)
    if (!hold_strongly(phys, args[0], weak)) return nullptr;
    Py_RETURN_NONE;
  }
  if (weak_expired(weak)) Py_RETURN_NONE;  // (gone: Buf.get() is None)
  Ref c(new_weak_buf(weak_ptr(weak)));
  if (!c) return nullptr;
  Py_INCREF(Py_True);
  Py_SETREF(slot_at(c.get(), env.buf_shared), Py_True);
  if (PyDict_SetItem(phys, args[0], c.get()) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef FastPath_methods[] = {
    {"constant", FastPath_constant, METH_O,
     "constant(storage) -> core tensor: DTRMode._constant on this path (a storage from before the block)."},
    {"carried", FastPath_carried, METH_NOARGS,
     "carried() -> [Buf]: DTRMode._carried on this path (what the next block on the device counts)."},
    {"on_pin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastPath_on_pin)), METH_FASTCALL,
     "The core's on_pin hook while this path runs (DTRMode._on_pin's steps)."},
    {"on_compute", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastPath_on_compute)), METH_FASTCALL,
     "The core's on_compute hook while this path runs (DTRMode._on_compute for a recomputation)."},
    {"on_evict", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastPath_on_evict)), METH_FASTCALL,
     "The core's on_evict hook while this path runs (DTRMode._on_evict where it has work)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef FastPath_getset[] = {
    {"__self__", FastPath_self, FastPath_set_self, "the mode (as for a bound method); settable", nullptr},
    {"counts", FastPath_counts, nullptr, "(ops run here, ops handed to the reference)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject FastPathType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// -------------------------------------------------------------------- module
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
  predictions.clear();
  op_infos.clear();
  op_keepalive.clear();
  Py_RETURN_NONE;
}


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

PyMethodDef module_methods[] = {
    {"configure", configure, METH_O, "configure(env): the reference's classes and helpers (dtr/runtime/native.py)."},
    {"buf_dead", buf_dead_py, METH_O, "buf_dead(buf): Buf.dead() as this module reads it."},
    {"clear_cache", clear_cache, METH_NOARGS, "Forget every cached signature and op."},
    {"key_enter", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(key_enter)), METH_FASTCALL,
     "key_enter(fastpath, reference): take the dispatch key for this block; False if another block has it."},
    {"key_exit", key_exit, METH_NOARGS, "key_exit(): give the dispatch key back."},
    {"key_exclude", key_exclude, METH_O, "key_exclude(flag) -> previous: skip the key in this thread."},
    {"key_active", key_active, METH_NOARGS, "key_active(): whether this thread's ops go to the key's entry now."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dtr._native",
                          "The runtime's per-op path in C++ (see Note [The native per-op path]).", -1,
                          module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__native() {
  if (!intern_names()) return nullptr;
  FastPathType.tp_name = "dtr._native.FastPath";
  FastPathType.tp_basicsize = sizeof(FastPath);
  FastPathType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  FastPathType.tp_doc = "FastPath(mode, fallback): a DTRMode's __torch_dispatch__ in C++.";
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
