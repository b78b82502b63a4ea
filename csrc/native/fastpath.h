// fastpath.h - dtr._native's internal header: what its units share, and the functions they call across files.
//
// The module (Note [The native per-op path] in fastpath.cpp) is cut along the
// Python it mirrors, one unit per part of the reference:
//   table.cpp       dtr/runtime/storage_table.py (StorageTable, Buf), and Driver's steps over the table
//                   (_track, _constant, _carried, _on_evict, _on_pin);
//   liveness.cpp    dtr/runtime/liveness.py (Liveness: release, polls, worth_keeping);
//   prediction.cpp  dtr/runtime/prediction.py (signatures and the per-signature cache), and the op cache;
//   dispatch.cpp    ReferencePath._dispatch and _execute: the per-op steps up to and including the op;
//   commit.cpp      ReferencePath._commit: what runs after the op;
//   fastpath.cpp    the two entries (the mode's __torch_dispatch__ and the dispatch key), the reference's fallback;
//   module.cpp      the FastPath type and its hooks, configure() and the module.
// A function that mirrors a Python function carries its name as <unit>_<method> (table_write for
// StorageTable.write, mode_commit for ReferencePath._commit) and a comment naming its twin; the Python-object
// helpers every unit uses are in py_object.h. Everything is in dtr::native, hidden (-fvisibility=hidden): the
// module exports only PyInit__native.
#pragma once

#include "py_object.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <c10/core/Device.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <vector>

#include "core_api.h"

namespace c10 {
class OperatorHandle;
}

namespace dtr::native {

inline const DtrCoreApi* api = nullptr;  // dtr._C's table (Note [The core's C route] in core_api.h)

// -------------------------------------------------------------------- the path
struct FastPath {
  PyObject_HEAD
  PyObject* mode;      // owned
  PyObject* table;     // mode.table (set once, in Driver.__init__), owned
  PyObject* liveness;  // mode.liveness (likewise), owned
  PyObject* fallback;  // the entry's __torch_dispatch__ (dtr/runtime/entry.py) (the class's function), owned
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

inline PyObject* mget(FastPath* f, S name) {  // the mode's slot, borrowed; null with no error set if it is unset
  return slot_at(f->mode, mode_slots[static_cast<int>(name)]);
}

inline long mget_long(FastPath* f, S name) {
  PyObject* v = mget(f, name);
  return v ? PyLong_AsLong(v) : -1;
}

inline bool mset_long(FastPath* f, S name, long v) {
  PyObject* o = cached_int(v);
  if (o == nullptr) return false;
  Py_XSETREF(slot_at(f->mode, mode_slots[static_cast<int>(name)]), o);
  return true;
}

inline PyObject* recipes_of(FastPath* f) {  // the mode's recipes (its Recomputer's), borrowed
  return slot_at(mget(f, S::recomputer), recipes_slot);
}

inline PyObject* tget(FastPath* f, T name) {  // the storage table's slot, borrowed (its maps are always set)
  return slot_at(f->table, table_slots[static_cast<int>(name)]);
}

inline PyObject* lget(FastPath* f, L name) {  // the liveness's slot, borrowed (always set)
  return slot_at(f->liveness, liveness_slots[static_cast<int>(name)]);
}

// core.storage_of(t), through the core's C table (a bounds-checked read; -1 with an error set if t is unknown).
inline int storage_of(FastPath* f, long t) { return api->storage_of(f->c, static_cast<int>(t)); }

// The buffer of core storage s (borrowed), or null (with an error set if the lookup failed).
inline PyObject* phys_of(PyObject* phys, int s) {
  Ref key(cached_int(s));
  if (!key) return nullptr;
  PyObject* b = PyDict_GetItemWithError(phys, key.get());
  if (b == nullptr && !PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%d", s);
  return b;
}

// ------------------------------------------------------------------ signatures
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
  static PyObject* out_layout_or(PyObject* cached, c10::IntArrayRef v);
  // A new reference to a tuple of v for output k's shape (which 0) or stride (which 1).
  PyObject* out_layout(size_t k, int which, c10::IntArrayRef v);
};

struct OpInfo {
  bool fast = false, seeded = false;
  bool inplace = false;  // may run as an in-place op on its first argument (mode._native_op_info)
  Ref name;
  Ref call;  // what runs the op (mode._native_op_info: the overload's C++ operator)
};

// The dispatch key the entry takes (Note [The dispatch-key entry] in fastpath.cpp).
constexpr c10::DispatchKey kEntryKey = c10::DispatchKey::Fake;

// An op that arrived through the dispatch key (Note [The dispatch-key entry]): where it is on the stack.
struct KeyCall {
  const c10::OperatorHandle* op;
  c10::DispatchKeySet ks;
  torch::jit::Stack* stack;
  size_t n_args;
};

// One op on this path, as mode_dispatch's steps find it and mode_commit reads it.
struct OpCall {
  FastPath* f;
  PyObject* func;
  const OpInfo* info;
  Scratch& scratch;
  Entry* e = nullptr;        // its signature's
  long ops_seen = 0;         // the mode's ops_seen, which nothing changes while an op runs
  long written = -1;         // the version an in-place op writes (its first argument's), or -1
  bool to_constant = false;  // and whether it is a constant's (no new version: reference.py's const_writes)
  Ref rng;                   // the generator states its recipe records, or None
  double cost = 0.0;         // what the core is told it cost
  int op = -1;               // the core's op
};

// -------------------------------------------------------------- table.cpp: Buf
int buf_dead(PyObject* b);
bool buf_gone(PyObject* b);
c10::StorageImpl* buf_get(PyObject* b);
PyObject* new_weak_buf(c10::StorageImpl* impl);

// ----------------------------------------------------- table.cpp: StorageTable
Ref table_add(FastPath* f, long t, int s, c10::StorageImpl* impl, PyObject* buf);
Ref table_write(FastPath* f, long old, long new_version, int old_storage, int new_storage, const at::Tensor& st);
Ref table_drop(FastPath* f, PyObject* h);
bool table_computed_from(FastPath* f, const std::vector<long>& ins);
bool table_hold(PyObject* phys, PyObject* key, PyObject* weak);
bool table_pinned(FastPath* f, PyObject* key, bool strongly);
PyObject* table_new_handle(FastPath* f);

// ------------------------------------------- table.cpp: Driver over the table
long mode_track(FastPath* f, PyObject* x);
int written_version(FastPath* f, PyObject* x, long* out);
PyObject* mode_constant(FastPath* f, PyObject* st);
PyObject* mode_carried(FastPath* f);
int mode_on_evict(FastPath* f, int s);
bool mode_on_pin(FastPath* f, PyObject* s);

// ---------------------------------------------------------------- liveness.cpp
bool liveness_due(FastPath* f, long ops_seen, int64_t need);
bool liveness_saw(FastPath* f, Ref handles);
bool liveness_release(FastPath* f, PyObject* h);
int liveness_worth_keeping(FastPath* f, int s, std::vector<int>& targets);
bool liveness_poll_recent(FastPath* f, PyObject* recent, Scratch& scratch);
bool liveness_poll_full(FastPath* f, Scratch& scratch);

// -------------------------------------------------------------- prediction.cpp
bool scan_args(PyObject* func, PyObject* args, PyObject* kwargs, Scan& s);
Entry* prediction_of_op(FastPath* f, PyObject* func, PyObject* args, PyObject* kwargs, Scan& s);
bool entry_flops(FastPath* f, Entry* e, PyObject* func, PyObject* args, PyObject* kwargs);
const OpInfo* op_info(PyObject* func);
void prediction_clear();

// ---------------------------------------------------- dispatch.cpp, commit.cpp
PyObject* mode_dispatch(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                        const KeyCall* kc);
PyObject* mode_commit(OpCall& call, PyObject* out);

// ---------------------------------------------------------------- fastpath.cpp
PyObject* run_fallback(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                       const KeyCall* kc);
PyObject* mode_torch_dispatch(FastPath* f, PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                              const KeyCall* kc);
PyObject* key_enter(PyObject*, PyObject* const* args, Py_ssize_t n);
PyObject* key_exit(PyObject*, PyObject*);
PyObject* key_exclude(PyObject*, PyObject* flag);
PyObject* key_active(PyObject*, PyObject*);

// ------------------------------------------------------------------ module.cpp
extern PyTypeObject FastPathType;

// ------------------------------------------------------------------- twins.cpp
PyObject* twin(PyObject*, PyObject* const* args, Py_ssize_t n);

}  // namespace dtr::native
