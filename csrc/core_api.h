// A C function table over one dtr::Core, for a native driver built as another extension module.
//
// Note [The core's C route]
// dtr._C is reached from Python through dtr.core's facade. The runtime's
// native per-op path (dtr._native, csrc/native/) is C++ built against torch
// and must not link the core a second time (two copies of its code over one
// object) nor pay a Python call per query (about 0.3 us each through pybind:
// a dozen per op). So dtr._C exports this table of plain C functions in a
// capsule (dtr._C._core_api), and each Core hands out its address in another
// (Core._capsule()). The table is the facade's own operations, nothing more:
// queries that never fail, and the calls that may evict, recompute (running
// the driver's hooks) or fail, which return -1 with the Python exception set
// exactly as the bound method would have raised it (the same translators).
// Every function must be called with the GIL held. Only ints, floats and ids
// cross it: the core stays torch-free.
#pragma once
#include <stdint.h>

#define DTR_CORE_API_VERSION 8
#define DTR_CORE_API_CAPSULE "dtr._C._core_api"
#define DTR_CORE_CAPSULE "dtr._C.Core"

extern "C" {
struct DtrCoreApi {
  int version;  // DTR_CORE_API_VERSION
  // Queries: ids must be valid; -1 only with a Python exception set.
  int (*storage_of)(void* core, int t);
  int (*defined)(void* core, int t);
  int (*pinned)(void* core, int s);
  int (*resident)(void* core, int s);
  int64_t (*storage_refs)(void* core, int s);
  int64_t (*memory)(void* core);
  int64_t (*peak_memory)(void* core);
  int64_t (*budget)(void* core);
  double (*base_compute)(void* core);
  double (*remat_compute)(void* core);
  // Core::set_thrash_limit: the thrash limit against the core's own first computations (inf: none).
  void (*set_thrash_limit)(void* core, double limit);
  // Calls (Core's methods of the same names): -1 with a Python exception set on failure.
  // begin_call: new outputs of sizes[0..n_out), none an alias or in-place; returns the op.
  int (*begin_call)(void* core, const int* inputs, int n_in, const int64_t* sizes, int n_out, double cost);
  int (*end_call)(void* core, int op, double cost);
  int (*abort_call)(void* core, int op);
  // op's outputs: writes min(count, cap) ids to out; returns count.
  int (*op_outputs)(void* core, int op, int* out, int cap);
  int (*release)(void* core, int t);
  int (*forget)(void* core, int s);
  // dtr::remat_allowance (csrc/core.h): the rule's one owner. Never fails.
  double (*remat_allowance)(double thrash_limit, double base);
  // Core::compute_hook_first: 0 reports only recomputations to the on_compute hook.
  void (*set_compute_hook_first)(void* core, int on);
  // Core::constant: a pinned tensor of size bytes that existed before; returns it.
  int (*constant)(void* core, int64_t size);
  // Core::on_evict as a C function: fn(ctx, storage, by_heuristic) returns 0, or -1 with a Python exception
  // set, which the core's caller then raises. ctx is a Python object (PyObject*) the hook keeps a reference
  // to; fn == NULL clears the hook. Setting the hook from Python (Core.on_evict) replaces it, as usual.
  int (*set_evict_hook)(void* core, int (*fn)(void* ctx, int s, int by_heuristic), void* ctx);
  // begin_call with inplace_of[0..n_out) (Core::begin_call): output i >= 0 there is a new version of input
  // inplace_of[i], of that storage's size sizes[i]; none is an alias. Returns the op.
  int (*begin_call_inplace)(void* core, const int* inputs, int n_in, const int64_t* sizes, const int* inplace_of,
                            int n_out, double cost);
  // A storage's size in bytes (Core.storage_size); -1 with a Python exception set.
  int64_t (*storage_size)(void* core, int s);
  // The storages protect(s) would pin or complete now (Core::protect_targets): the first cap of them in out;
  // returns how many there are, or -1 with a Python exception set.
  int (*protect_targets)(void* core, int s, int* out, int cap);
  // Core::protect(s): pin what still needs constant s's value (may recompute); 0, or -1 with an exception set.
  int (*protect)(void* core, int s);
  // How many storages are computed from s (Core::storage_dependents); -1 with a Python exception set.
  int (*dependents)(void* core, int s);
};
}
