// core.h - the DTR eviction core: storages, tensors, operators, heuristics.
//
// Torch-free: it only sees ids, byte sizes and costs. Two drivers use it: the
// log replayer (dtr.sim, a virtual clock) and the PyTorch runtime (dtr.runtime,
// which carries out the core's decisions on real storages through callbacks).
//
// Model (simrd, section 4): a *storage* is a buffer of bytes; a *tensor* is a
// view of one storage, produced by one operator; an *operator* maps input
// tensors to output tensors at some cost. The root tensor of a storage is the
// one whose operator allocates it; alias tensors (views) add no bytes. Eviction
// and rematerialization are per storage: evicting a storage undefines every
// tensor viewing it; rematerializing a tensor reruns its operator (recursively
// rematerializing its inputs first).
//
// Invariants (checked by Core::check()):
//  * memory == sum of sizes of resident storages; peak >= memory;
//  * a storage is in the pool iff it is resident, unlocked and not pinned;
//  * a defined tensor's storage is resident;
//  * a storage with an eviction component node is evicted, and vice versa;
//  * with Config::eqclass_split, the components are exactly the connected
//    components of the evicted (not banished) storages, and each one's value is
//    the sum of its members' costs;
//  * refs(S) == sum of refs of its tensors;
//  * a collected storage is evicted, banished and has no eqclass node; a
//    collected op is never computed again: each of its outputs is on a
//    collected or banished storage, or on a pinned one, where it is defined or
//    unreferenced and read by no op that is not collected (see Note
//    [Collection and compaction]).
//
// The implementation, one file per subsystem: core_graph.cpp (building the
// graph, costs, references and locks), core_materialize.cpp (require, pin,
// protect, recomputation), core_evict.cpp (the pool, choosing a victim, the
// bound tree, eviction and banishing), core_eqclass.cpp (evicted
// neighbourhoods: union-find components and e*), core_compact.cpp (collect,
// compact) and core_check.cpp (check); core_internal.h has their shared helpers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dtr {

// Which compute-cost term a heuristic uses (simrd section 4.3).
enum class CostMode : int { None = 0, Local = 1, EqClass = 2, Full = 3 };

// The rules that differ between dtr's runtime and simrd (dtr.semantics.Semantics on the Python side,
// which a log's meta line records): all false is simrd's, all true the runtime's.
struct Semantics {
  bool free_dead_constants = false;  // free a constant when its last reference dies (after protect())
  bool keep_needed = false;     // see Note [Freeing what an evicted tensor needs] in core_graph.cpp
  bool eqclass_split = false;   // eqclass: exact components (Note [Splitting eqclass components], core_eqclass.cpp)
  bool inplace_handover = false;  // a recomputed in-place write takes its old version's bytes
                                  // (Note [Handing bytes over on recomputation])
  bool deep_first = false;      // recompute the evicted inputs that need recursion first (Note [Deepest input first])
};

struct Config {
  int64_t budget = -1;          // bytes; negative = no limit
  CostMode cost = CostMode::EqClass;
  bool use_size = true;         // divide by size(S)
  bool use_staleness = true;    // divide by stale(S)
  bool random = false;          // uniform choice over the pool (seeded)
  bool banish = false;          // banish on last release instead of eager eviction
  uint64_t seed = 0;
  int sample = 0;               // >0: score only this many random pool members per eviction
  // The thrash limit X (Note [The thrash limit] in dtr/semantics.py): the core stops (Thrashing) once its
  // recomputation passes what X allows over a base, in compute (remat_allowance) or in recomputations
  // (remat_count_allowance). The base is thrash_base / thrash_base_ops where they are >= 0 (a replay: the
  // whole log's), else the core's own first computations so far (the runtime). Infinity: no limit.
  double thrash_limit = std::numeric_limits<double>::infinity();
  double thrash_base = -1;
  // A fixed cap on recomputation compute, whatever the thrash limit (tests compare the core with a reference
  // under it). Infinity: none.
  double remat_limit = std::numeric_limits<double>::infinity();
  int64_t thrash_base_ops = -1;
  Semantics semantics;
};

struct Counters {
  double base_compute = 0;      // cost of first computations
  double remat_compute = 0;     // cost of rematerializations
  int64_t base_ops = 0;         // first computations (constants are not computed: none of them counts)
  int64_t evictions = 0;        // evictions chosen by the heuristic
  int64_t eager_evictions = 0;  // storages evicted because their last handle died
  int64_t banishments = 0;
  int64_t remats = 0;           // operator recomputations
  int64_t memory = 0;           // bytes resident now
  int64_t peak_memory = 0;
  int64_t storage_accesses = 0; // metadata touched by heuristic evaluation and maintenance
  int64_t heuristic_evals = 0;
  int64_t largest_op_bytes = 0; // max over (re)computations of outputs + inputs' own bytes
  int64_t constant_bytes = 0;
  int64_t planned_evictions = 0;  // evictions a followed plan made (Note [Following a plan] in core_follow.cpp)
  int64_t planned_remats = 0;     // recomputations a followed plan made before they were needed
};

// A plan to follow (Note [Following a plan] in core_follow.cpp). Ops are named by their ordinal: the count of
// ops created before them since the core began fingerprinting (set_plan or record_fingerprints).
struct PlanStep {
  int kind;   // 0: evict output `index` of op `op`'s storage; 1: recompute op `op`
  int op;     // an ordinal
  int index;  // an output position (kind 0)
};
struct FollowPlan {
  std::vector<uint64_t> fingerprints;  // per ordinal of the recorded step: what its op looked like
  std::vector<int> starts;             // per ordinal k: its steps are steps[starts[k], starts[k + 1])
  std::vector<PlanStep> steps;
  int64_t start_limit = -1;  // the most bytes resident at the first op for it to be followed (-1: any;
                             // Note [A step that starts with more] in core_follow.cpp)
};

// Why a resident storage could not be evicted when room ran out (Note [What filled the budget] in
// core_evict.cpp). The first five are why it is pinned (Core::pin's `why`, or the core's own pins), the
// last three why it is locked.
enum class Hold : int {
  Constant = 0,      // a constant (Core::constant): it existed before the program
  Protected = 1,     // pinned by protect(): computed from a constant that was written or dropped
  Escaped = 2,       // pinned by the driver: its bytes were read outside the graph
  VersionChain = 3,  // pinned by the driver: a long chain of in-place versions
  Output = 4,        // pinned by the driver: held by the program at its end (the output condition)
  Pinned = 5,        // pinned by the driver, for no reason it gave
  Input = 6,         // locked: an input of the op whose room was being made
  Recompute = 7,     // locked: read by a recomputation in progress
  Locked = 8,        // locked by the driver
};
constexpr int kHoldReasons = 9;

// One unevictable resident storage at the moment room ran out.
struct Held {
  int storage;
  int64_t size;
  Hold why;
  bool referenced;   // the driver holds a reference to one of its tensors
};

// Raised when no eviction can make room. `needed` is the memory that had to be
// resident at that moment (everything unevictable plus the request).
struct OutOfMemory : std::runtime_error {
  int64_t needed, budget;
  int64_t request = 0;   // the bytes the failing (re)computation needed
  int op = -1;           // the op of the begin_call in progress (-1: none, e.g. a driver's pin or protect)
  int remat_op = -1;     // the op being recomputed when room ran out (-1: the op itself was being begun)
  int64_t evictable = 0; // bytes still in the eviction pool (0: everything evictable was evicted)
  std::vector<Held> held;  // every resident storage, largest first (each unevictable, as evictable == 0)
  OutOfMemory(int64_t needed_, int64_t budget_)
      : std::runtime_error("out of memory: needed " + std::to_string(needed_) + " bytes, budget " +
                           std::to_string(budget_)),
        needed(needed_), budget(budget_) {}
};

// The rematerialization compute a thrash limit allows over `base` compute: (thrash_limit - 1) * base, at
// least 0. An infinite limit, or a base of 0 (nothing has cost anything yet, so nothing recomputed can cost
// anything either), allows any. Never smaller for a larger base: the runtime's native per-op path relies on
// that to ask once per op. The one owner of this rule (dtr.semantics.remat_allowance and the runtime ask it).
inline double remat_allowance(double thrash_limit, double base) {
  if (std::isinf(thrash_limit) || base <= 0) return std::numeric_limits<double>::infinity();
  return std::max(0.0, thrash_limit - 1.0) * base;
}

// Note [Counting recomputations]
// A limit on recomputation compute alone does not bound a run: ops that cost
// nothing (views, and any op under a cost model that gives it 0) can be
// recomputed for ever, and did (Hugging Face's KV-cache generation under a
// budget recomputed views and concatenations at 10,000 a second with no end).
// So the thrash limit X also bounds the number of recomputations: at most
// (X - 1) times the number of first computations. A run stops when either
// count passes its allowance. Like remat_allowance, never smaller for a
// larger base, and the one owner of the rule.
inline int64_t remat_count_allowance(double thrash_limit, int64_t base_ops) {
  if (std::isinf(thrash_limit)) return std::numeric_limits<int64_t>::max();
  const double a = std::max(0.0, thrash_limit - 1.0) * double(std::max<int64_t>(base_ops, 0));
  return a >= 9.0e18 ? std::numeric_limits<int64_t>::max() : int64_t(a);
}

// Raised when recomputation passes the thrash limit (Config::thrash_limit), in compute or in count.
struct Thrashing : std::runtime_error {
  double remat_compute, limit;   // recomputation compute, and what the limit allowed of it
  int64_t remats, count_limit;   // recomputations, and how many the limit allowed
  Thrashing(double rc, double lim, int64_t n, int64_t n_lim)
      : std::runtime_error("thrashing: " + std::to_string(n) + " recomputations (allowed " + std::to_string(n_lim) +
                           "), compute " + std::to_string(rc) + " (allowed " + std::to_string(lim) + ")"),
        remat_compute(rc), limit(lim), remats(n), count_limit(n_lim) {}
};

class Core {
 public:
  explicit Core(const Config& cfg);

  // --- building the graph (each call computes the operator now) -------------
  // A pinned, non-rematerializable tensor of `size` bytes, with one reference.
  int constant(int64_t size);
  // outputs = op(inputs). sizes[i] bytes for output i unless alias_of[i] >= 0,
  // the index of the input whose storage output i views. Each output starts with
  // one reference. Returns the output tensor ids (consecutive).
  std::vector<int> call(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                        const std::vector<int>& alias_of, double cost);
  // In-place op writing inputs[j] for j in `mutated` (simrd's reference layer):
  // a fresh copy of each mutated storage is computed from all inputs, then the
  // old tensors lose one reference. Returns the new tensor ids.
  std::vector<int> mutate(const std::vector<int>& inputs, const std::vector<int>& mutated, double cost);
  // A true in-place op (the runtime's view of `x.add_(y)`): for each written
  // input j, a new version of its storage is computed from all inputs and takes
  // over the old version's bytes and references; the old version is evicted
  // (its buffer now holds the new value) but stays recomputable. Needs no new
  // memory. A written constant keeps its storage; see protect(). Returns the
  // new tensors, -1 for constants.
  std::vector<int> mutate_inplace(const std::vector<int>& inputs, const std::vector<int>& mutated, double cost);
  // An op with ordinary outputs that also writes inputs[j] in place for j in
  // `mutated` (e.g. batch norm updating running statistics). Returns the
  // ordinary outputs followed by one new version per written input (-1 for a
  // constant, which is protect()ed and keeps its storage; so is a written input
  // that protecting another one pinned).
  std::vector<int> call_inplace(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                                const std::vector<int>& alias_of, const std::vector<int>& mutated, double cost);

  // --- two-phase calls (a driver that runs the real op in between) -------------
  // begin_call creates the op and its outputs (one reference each), brings the
  // inputs back, locks them and makes room for the outputs. inplace_of[i] >= 0
  // marks output i as a new version of input inplace_of[i] (sizes[i] is then
  // that storage's size, and no room is made for it). Returns the op id. If
  // making room fails (out of budget, thrashing), it throws with nothing left
  // locked and the outputs dropped: no abort_call is needed.
  int begin_call(const std::vector<int>& inputs, const std::vector<int64_t>& sizes, const std::vector<int>& alias_of,
                 const std::vector<int>& inplace_of, double cost);
  // The real op ran (and cost `cost`): account for it and unlock the inputs.
  void end_call(int op, double cost);
  // The real op failed: unlock the inputs and forget the outputs.
  void abort_call(int op);
  // A finished op (end_call returned) really cost `cost` (a driver that learns
  // op times later, e.g. from CUDA events): its cost, its storages' costs, the
  // eqclass component of an evicted one and the e* caches follow, and
  // base_compute is corrected; the clock is not rewritten (see Note [Changing
  // an op's cost] in core_graph.cpp).
  void set_cost(int op, double cost);
  // Before a constant is overwritten in place: every live storage whose
  // recomputation would read its old value is brought back and pinned, with
  // its referenced tensors defined (see Note [Protecting a constant] in core_materialize.cpp).
  void protect(int storage);
  // The storages protect(storage) would pin or complete now: referenced,
  // not constants all of whose tensors are defined, and computed from
  // `storage` through storages that are not such constants.
  std::vector<int> protect_targets(int storage);
  // Garbage collection of the graph (see Note [Collection and compaction]).
  // A storage that can never be needed again (not referenced, not pinned, and
  // not needed to recompute anything that is referenced, except through
  // constants and banished storages) is *collected*: freed if resident (counted as an eager
  // eviction), banished and taken out of its evicted neighbourhood. An op is
  // collected once it can never run again: each of its outputs is on a
  // storage that can never be needed again (collected, or a dead constant
  // kept resident), on a banished one, or a defined tensor of a pinned one.
  // Returns the ops and the storages collected by this call (each is
  // returned once); a driver drops its recipes of those ops and its buffers
  // of those storages.
  // Collected tensors must not be used again (as inputs, retained, required).
  // O(storages + ops + edges).
  std::pair<std::vector<int>, std::vector<int>> collect();
  // Drops what collect() made unreachable and renumbers the rest, keeping
  // the relative order of ids. Returns the old -> new id maps of ops,
  // tensors and storages (-1: dropped). The core's later decisions are those
  // it would have taken without compaction. Call it between calls only.
  // O(ops + tensors + storages + edges).
  struct Remap {
    std::vector<int> ops, tensors, storages;
  };
  Remap compact();

  // --- references, locks -----------------------------------------------------
  void retain(int t);
  void release(int t);
  // Rematerialize `t` if it is undefined (touching nothing else).
  void require(int t);
  // Rematerialize `t` if needed, then lock its storage for good (output
  // condition, escaped memory); `why` says why, for an out-of-memory report
  // (one of Hold's pin reasons). Pinning twice is a no-op.
  void pin(int t, Hold why = Hold::Pinned);
  // pin(t, why) for each of ts, as one materialization (Note [Planned
  // recomputation] in core_materialize.cpp): what several of them need is
  // recomputed once.
  void pin_many(const std::vector<int>& ts, Hold why = Hold::Pinned);
  void lock(int s);
  void unlock(int s);

  // --- queries ----------------------------------------------------------------
  const Counters& counters() const { return c_; }
  double clock() const { return clock_; }
  int64_t budget() const { return cfg_.budget; }
  void set_budget(int64_t b) { cfg_.budget = b; }
  // The thrash limit X, against the core's own first computations so far (Config::thrash_limit).
  void set_thrash_limit(double x) {
    cfg_.thrash_limit = x;
    cfg_.thrash_base = -1;
    cfg_.thrash_base_ops = -1;
  }
  double thrash_limit() const { return cfg_.thrash_limit; }
  void set_remat_limit(double l) { cfg_.remat_limit = l; }
  // Recomputation compute and count the thrash limit allows now (Note [Counting recomputations]).
  double remat_allowed() const;
  int64_t remats_allowed() const;
  // The peak starts again from the memory now (a nested budget's own peak); returns the old peak.
  int64_t restart_peak() {
    const int64_t old = c_.peak_memory;
    c_.peak_memory = c_.memory;
    return old;
  }
  void raise_peak(int64_t p) { c_.peak_memory = std::max(c_.peak_memory, p); }
  // Evict until the memory is within the budget (a budget that just shrank); throws OutOfMemory if it cannot.
  void fit_budget() { make_room(0); }
  int num_tensors() const { return int(tensors_.size()); }
  int num_storages() const { return int(storages_.size()); }
  int num_ops() const { return int(ops_.size()); }
  // Storages in the tables that collect() has collected (compact() drops them).
  int num_collected_storages() const { return num_collected_; }
  bool collected(int s) const { return storages_.at(s).collected; }
  bool op_collected(int op) const { return ops_.at(op).collected; }
  const std::vector<int>& storage_tensors(int s) const { return storages_.at(s).tensors; }
  int storage_of(int t) const { return tensors_.at(t).storage; }
  int op_of(int t) const { return tensors_.at(t).op; }
  bool defined(int t) const { return tensors_.at(t).defined; }
  bool resident(int s) const { return storages_.at(s).resident; }
  bool pinned(int s) const { return storages_.at(s).pinned; }
  // Why s is pinned (a Hold pin reason; meaningful only while it is pinned).
  Hold pin_reason(int s) const { return storages_.at(s).pin_reason; }
  // Banished (or collected): never resident again; a recomputation of its op frees it at once.
  bool banished(int s) const { return storages_.at(s).banished; }
  bool handed(int s) const { return storages_.at(s).handed; }
  int locks(int s) const { return storages_.at(s).locks; }
  int64_t refs(int t) const { return tensors_.at(t).refs; }
  int64_t storage_refs(int s) const { return storages_.at(s).refs; }
  // The storages that storage `s`'s tensors are computed from.
  const std::vector<int>& storage_deps(int s) const { return storages_.at(s).deps; }
  // The storages computed from s's tensors (the reverse of storage_deps).
  const std::vector<int>& storage_dependents(int s) const { return storages_.at(s).dependents; }
  // The driver lost the memory of an unreferenced resident storage (it was
  // kept for an evicted dependent but could not be held): mark it evicted.
  void forget(int s);
  int64_t storage_size(int s) const { return storages_.at(s).size; }
  double storage_cost(int s) const { return storages_.at(s).cost; }
  int pool_size() const { return int(pool_.size()); }
  // Evicted-neighbourhood cost term of `s` under the configured cost mode.
  double neighbourhood_cost(int s);

  // Throws std::logic_error describing the first violated invariant.
  void check() const;

  // Following a plan (Note [Following a plan] in core_follow.cpp).
  void set_plan(FollowPlan plan);
  void record_fingerprints(bool on);
  const std::vector<uint64_t>& fingerprints() const { return fps_; }
  bool following() const { return following_; }
  int64_t plan_followed() const { return following_ ? ordinal_ : plan_diverged_; }
  int64_t plan_diverged_at() const { return plan_diverged_; }
  int64_t start_memory() const { return start_memory_; }  // bytes resident at the first op (-1: none yet)
  int64_t plan_length() const { return int64_t(plan_.fingerprints.size()); }

  // --- hooks for a driver that owns real memory --------------------------------
  // on_evict(storage, by_heuristic): after a storage is marked evicted (by the
  // heuristic, or because its last reference died / it was banished).
  std::function<void(int, bool)> on_evict;
  // on_compute(op, remat): after room is made and before the op's outputs are
  // marked resident; the driver (re)computes the op's outputs here. An op
  // with no outputs is reported once, when end_call accounts for it.
  std::function<void(int, bool)> on_compute;
  // false: on_compute is called for recomputations only (a driver with nothing to do for a first
  // computation, the runtime's native per-op path, saves a call per op).
  bool compute_hook_first = true;
  // on_pin(storage): a storage became a constant (it must be kept from now on).
  std::function<void(int)> on_pin;

  // --- graph queries (drivers, schedule export) -------------------------------
  // After compact(), an input of a collected op that was dropped reads -1.
  const std::vector<int>& op_inputs(int op) const { return ops_.at(op).inputs; }
  const std::vector<int>& op_outputs(int op) const { return ops_.at(op).outputs; }
  const std::vector<int64_t>& op_sizes(int op) const { return ops_.at(op).sizes; }
  double op_cost(int op) const { return ops_.at(op).cost; }
  int tensor_index(int t) const { return tensors_.at(t).index; }
  bool is_alias(int t) const { return tensors_.at(t).alias; }
  int storage_root(int s) const { return storages_.at(s).root; }

 private:
  // pin_many's attempts: require and lock each of `first`, then of `then`; the locks are given back at the end
  // and on a failure (Note [The order of a bring-back] in core_materialize.cpp).
  void bring_back(const std::vector<int>& first, const std::vector<int>& then, Hold why);
  // Whether t and what its recomputation needs can be recomputed (Note [Following a plan] in core_follow.cpp).
  bool recomputable(int t) const;
  // begin_call, and constant() without an ordinal (ordinal = false): no plan point, no fingerprint.
  int open_call(const std::vector<int>& inputs, const std::vector<int64_t>& sizes, const std::vector<int>& alias_of,
                const std::vector<int>& inplace_of, double cost, bool ordinal);
  struct Tensor {
    int storage, op, index;
    bool alias, defined = false;
    int64_t refs = 0;
  };
  struct Op {
    double cost;
    std::vector<int> inputs, outputs;
    std::vector<int64_t> sizes;  // per output; 0 for aliases
    std::vector<int> inplace_of;  // per output: input index it overwrites in place, or -1
    int64_t total_size = 0;
    int64_t inplace_bytes = 0;   // bytes of outputs that reuse an input's buffer (first compute)
    bool ended = false;          // end_call returned: its first computation is counted
    bool collected = false;
    bool planned = false;        // the materialization in progress will (re)compute it (Note [Planned recomputation])
    int64_t ordinal = -1;        // its ordinal while fingerprinting (Note [Following a plan])
  };
  struct Storage {
    int64_t size = 0;
    int root = -1;
    std::vector<int> tensors;
    std::vector<int> ops;         // distinct ops of its tensors (cost = sum of their costs)
    std::vector<int> deps, dependents;  // storage-level dependency graph (distinct, no self)
    int locks = 0;
    int64_t refs = 0;
    bool resident = false, pinned = false, banished = false, banish_pending = false;
    bool evict_on_unlock = false;  // its last reference died while it was locked
    int wanted = 0;                // frames of materialize() computing one of its tensors right now
    bool collected = false;        // returned by collect(): never needed again
    bool handed = false;           // its bytes go to the in-place write being recomputed from it right now
    Hold pin_reason = Hold::Pinned;  // why it is pinned (while it is)
    int need = 0;                  // planned recomputations that will read it (Note [Planned recomputation])
    int bringing = 0;              // pin_many's locks on it (Note [The order of a bring-back])
    double cost = 0;
    double last_access = -std::numeric_limits<double>::infinity();
    int pool_pos = -1;
    uint64_t pool_seq = 0;
    int uf = -1;                  // eqclass component node while evicted
    int uf_nbrs = 0;              // neighbour edges (deps + dependents) to storages with a node
    double full_cost = 0;         // cached e* cost (Full mode)
    bool full_dirty = true;
    uint64_t mark = 0;            // DFS stamp
    int bt_slot = -1;             // its leaf in the bound tree while in the pool (Note [Choosing without scanning])
    double bt_k = 0;              // its leaf's bound of c(S)/m(S) from S and its neighbours alone
    double bt_p = -std::numeric_limits<double>::infinity();  // eqclass: c(S) / m(S) when last computed, rounded down
    double bt_c = 0;              // eqclass: the term eval_score() found last
    bool bt_dirty = false;        // queued in bt_dirty_: its leaf is refreshed before the next choice
  };
  struct UFNode {
    int parent;
    double value;
  };

  Config cfg_;
  Counters c_;
  double clock_ = 0;
  std::vector<Tensor> tensors_;
  std::vector<Op> ops_;
  std::vector<Storage> storages_;
  std::vector<int> pool_;
  uint64_t next_seq_ = 0;
  std::vector<UFNode> uf_;
  int num_collected_ = 0;       // storages with `collected` set
  uint64_t stamp_ = 0;
  std::mt19937_64 rng_;
  // Note [Planned recomputation]: the ops the materialization in progress will run, and its nesting depth.
  std::vector<int> planned_ops_;
  int plan_depth_ = 0;
  int current_op_ = -1;         // the op of the begin_call in progress (for an out-of-memory report)
  Hold bringing_why_ = Hold::Pinned;  // the reason pin_many() pins for, while it brings back
  // Following a plan (Note [Following a plan] in core_follow.cpp).
  FollowPlan plan_;
  bool fp_on_ = false;          // fingerprinting: ops get ordinals, plan_op_ maps them back
  bool fp_keep_ = false;        // and fps_ keeps each op's fingerprint
  bool following_ = false;      // the ops so far matched plan_ (until the first that does not)
  int64_t ordinal_ = 0;         // the next op's ordinal
  int64_t plan_diverged_ = -1;  // the ordinal of the first op that did not match (-1: none)
  int64_t start_memory_ = -1;   // c_.memory at ordinal 0's plan point (-1: not reached)
  std::vector<int> plan_op_;    // ordinal -> op id (-1: dropped by compact())
  std::vector<uint64_t> fps_;
  // The bound tree (Note [Choosing without scanning]): a min-tree over slots
  // in pool order, each leaf one pool member; a node holds the least bound
  // of c/m and the least last access below it.
  bool bt_on_ = false;          // maintained (the heuristic scans the whole pool and bounds are exact)
  bool uf_deficient_ = false;   // eqclass without splitting gave a member cost its root does not hold
  int cost_bits_ = 0;           // fractional bits every cost fits in so far
  double cost_total_ = 0;       // an upper bound on any sum of costs (exact sums while < 2^53 at cost_bits_)
  int bt_cap_ = 0, bt_used_ = 0;
  std::vector<int> bt_sid_;     // slot -> storage (-1: empty)
  std::vector<double> bt_k_, bt_p_, bt_m_, bt_a_;  // heap-ordered nodes (1-based, leaves at bt_cap_ + slot)
  // eqclass: per component root, the pool members whose leaf bound counts its
  // value (stale entries allowed); a root whose value falls touches them.
  std::vector<std::vector<int>> uf_front_;
  std::vector<int> bt_dirty_;

  // Whether an op fingerprints as a write of its first input (Note [Sums in place or not] in core_follow.cpp).
  bool sums_like_a_write(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                         const std::vector<int>& alias_of, const std::vector<int>& inplace_of) const;
  uint64_t fingerprint(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                       const std::vector<int>& alias_of, const std::vector<int>& inplace_of) const;
  uint64_t plan_point(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                  const std::vector<int>& alias_of, const std::vector<int>& inplace_of);
  void follow_steps(int64_t k);
  int new_op(const std::vector<int>& inputs, const std::vector<int64_t>& sizes, const std::vector<int>& alias_of,
             double cost);
  struct Frame;                 // one level of materialize()'s explicit stack
  void materialize(int t, bool remat, bool stop_before_root = false);
  void plan(int t);            // add what materializing t will run to the plan (Note [Planned recomputation])
  void plan_done(int op_id);   // op ran: its reads are no longer needed by the plan
  void end_plan();             // the outermost materialization ended: drop what is left of the plan
  void check_thrash() const;   // throw Thrashing past the thrash limit
  OutOfMemory out_of_memory(int64_t bytes) const;  // the report of make_room(bytes) failing
  void push_frame(std::vector<Frame>& stack, int t, bool remat);
  void abandon_frames(const std::vector<Frame>& stack);  // materialize() failed: give back what they took
  void finish(int op_id);      // after compute(): unlock the inputs, free the handed-over ones, check the remat limit
  int64_t mark_handover(int op_id);
  void compute(int t, bool remat);
  void make_room(int64_t bytes);
  int choose();
  void evict(int s, bool by_heuristic);
  void banish(int s);
  void drop_garbage(int s, std::vector<int>* leaving = nullptr);
  std::vector<char> find_needed();  // collect(): per storage, whether it may be needed again
  void find_kept(std::vector<char>& keep_ops, std::vector<char>& keep_storages) const;  // compact()'s kept set
  Remap number_kept(const std::vector<char>& keep_ops, const std::vector<char>& keep_storages) const;
  void renumber_ops_and_tensors(const Remap& r);
  void renumber_storages(const Remap& r);  // and rebuild the union-find
  int uf_root(int n) const;     // uf_find without path compression or counting
  void check_alive_input(int t, const char* what) const;
  void try_banish(int s);
  void pool_add(int s);
  void pool_remove(int s);
  double raw_score(int s);
  int uf_find(int n);           // (inline, in core_internal.h)
  void uf_merge(int a, int b);
  double eqclass_cost(int s);
  double full_cost(int s);
  void dirty_frontier(int s);
  void after_remat(int s);
  bool needed_by_evicted(int s) const;
  void free_if_unneeded(int s);
  void touch_parents(int op);
  bool needs_recursion(int t) const;
  void lock_inputs(int op);  // see Note [Ops without outputs] in core_graph.cpp
  void drop_outputs(int op);  // an op that will not run: its outputs lose their references, unborn ones are banished
  void count_uf_nbrs(int sid, int delta);
  void uf_leave(int sid);
  struct UFSplit;               // uf_leave()'s lockstep searches
  UFSplit uf_split_search(const std::vector<int>& seeds, uint64_t base);
  void uf_split_off(UFSplit& split, int root, double cost);
  void uf_leave_all(const std::vector<int>& sids);
  void uf_rebuild(const std::vector<int>& seeds);
  double change_cost(int op_id, double cost, bool in_progress);
  // Bound tree (Note [Choosing without scanning]).
  double eval_score(int s);     // raw_score without counting a heuristic evaluation
  int choose_bounded();
  void note_cost(double cost, size_t storages);
  bool bounds_exact() const;
  void bt_sync();               // turn the tree on or off to match bounds_exact() and the config
  void bt_clear();              // drop the tree (off until the next bt_sync())
  void bt_rebuild();
  double bt_key(int s);         // a lower bound of c(S)/m(S) from S and its neighbours alone
  void bt_note(int s, double c);  // eqclass: S's c(S) is `c` now (rounded-down potential for its leaf)
  void bt_register(int s);      // eqclass: list S at each component root next to it
  void bt_walk(int root);       // eqclass: the root's value fell: refresh the bounds that count it
  void bt_set(int slot, int sid);
  void bt_insert(int s);
  void bt_erase(int s);
  void bt_touch(int s);         // refresh S's leaf before the next choice (inline, in core_internal.h)
  void bt_touch_nbrs(int s);    // ... and those of its neighbours
  void bt_flush();
  // check()'s groups of checks, in the order it runs them.
  void check_tensor_ids() const;
  std::vector<char> check_op_ids() const;  // returns which tensors an op that is not collected reads
  void check_collected_ops(const std::vector<char>& read_live) const;
  void check_storage_ids() const;
  void check_storages() const;
  void check_components() const;
  void check_bound_tree() const;
};

}  // namespace dtr
