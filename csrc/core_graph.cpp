// core_graph.cpp - the core's graph: building ops, tensors and storages (constant, call, two-phase
// calls, in-place writes, mutate), op costs, references and locks.
#include "core_internal.h"

#include <cmath>

namespace dtr {

// ---------------------------------------------------------------------------
// Graph construction

Core::Core(const Config& cfg) : cfg_(cfg), rng_(cfg.seed) {}

int Core::new_op(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                 const std::vector<int>& alias_of, double cost) {
  if (alias_of.size() != sizes.size()) throw std::invalid_argument("alias_of and sizes differ in length");
  if (!(cost >= 0) || !std::isfinite(cost)) throw std::invalid_argument("cost must be finite and >= 0");
  for (int u : inputs) {
    if (u < 0 || u >= int(tensors_.size())) throw std::invalid_argument("unknown input tensor " + std::to_string(u));
    if (storages_[tensors_[u].storage].collected)
      throw std::invalid_argument("input tensor " + std::to_string(u) + " was collected");
  }
  const int op_id = int(ops_.size());
  note_cost(cost, sizes.size());
  Op op;
  op.cost = cost;
  op.inputs = inputs;
  op.sizes.resize(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) throw std::invalid_argument("negative size");
    int a = alias_of[i];
    if (a >= int(inputs.size()) || a < -1) throw std::invalid_argument("alias index out of range");
    op.sizes[i] = a >= 0 ? 0 : sizes[i];
    op.total_size += op.sizes[i];
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int tid = int(tensors_.size());
    int sid;
    if (alias_of[i] >= 0) {
      sid = tensors_[inputs[alias_of[i]]].storage;
    } else {
      sid = int(storages_.size());
      storages_.emplace_back();
      storages_.back().size = sizes[i];
      storages_.back().root = tid;
    }
    tensors_.push_back(Tensor{sid, op_id, int(i), alias_of[i] >= 0});
    Storage& s = storages_[sid];
    s.tensors.push_back(tid);
    if (!contains(s.ops, op_id)) {
      s.ops.push_back(op_id);
      s.cost += cost;
      s.full_dirty = true;
      // (An alias output on an evicted storage: an exact component's value follows.)
      if (cfg_.semantics.eqclass_split && s.uf >= 0) uf_[uf_find(s.uf)].value += cost;
      else if (s.uf >= 0 && cost > 0) uf_deficient_ = true;  // its root misses this cost: no bounds (Note [Choosing without scanning])
    }
    for (int u : inputs) {
      int su = tensors_[u].storage;
      if (su == sid || contains(s.deps, su)) continue;
      s.deps.push_back(su);
      storages_[su].dependents.push_back(sid);
      if (storages_[su].uf >= 0) s.uf_nbrs += 1;
      if (s.uf >= 0) storages_[su].uf_nbrs += 1;
      // An alias output adds edges to an existing storage, which may be evicted
      // with its new dependency: exact components join (simrd's do not).
      if (cfg_.semantics.eqclass_split && s.uf >= 0 && storages_[su].uf >= 0) uf_merge(s.uf, storages_[su].uf);
    }
    op.outputs.push_back(tid);
  }
  ops_.push_back(std::move(op));
  // Note [Outputs in progress]: until it is computed, a new output storage is
  // not resident, so it belongs to the evicted neighbourhood of the resident
  // storages it is joined to through evicted ones (simrd counts it, as for any
  // storage that is "not material"). Their cached e* costs are stale now.
  if (cfg_.cost == CostMode::Full)
    for (int t : ops_[op_id].outputs)
      if (!storages_[tensors_[t].storage].resident) dirty_frontier(tensors_[t].storage);
  return op_id;
}

int Core::constant(int64_t size) {
  // (no ordinal: which constants a step declares, and when, is not the step's structure; Note [Following a
  // plan] in core_follow.cpp)
  const int op_id = open_call({}, {size}, {-1}, {}, 0.0, /*ordinal=*/false);
  end_call(op_id, 0.0);
  int t = ops_[op_id].outputs[0];
  Storage& s = storages_[tensors_[t].storage];
  c_.constant_bytes += s.size;
  c_.base_ops -= 1;  // (call() counted it: a constant is not computed)
  lock(tensors_[t].storage);
  s.pinned = true;
  s.pin_reason = Hold::Constant;
  return t;
}

std::vector<int> Core::call(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                            const std::vector<int>& alias_of, double cost) {
  const int op_id = begin_call(inputs, sizes, alias_of, {}, cost);
  end_call(op_id, cost);
  return ops_[op_id].outputs;
}

int Core::begin_call(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                     const std::vector<int>& alias_of, const std::vector<int>& inplace_of, double cost) {
  return open_call(inputs, sizes, alias_of, inplace_of, cost, /*ordinal=*/true);
}

int Core::open_call(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                    const std::vector<int>& alias_of, const std::vector<int>& inplace_of, double cost,
                    bool ordinal) {
  // Note [Following a plan] in core_follow.cpp: the plan's steps run first; the op then gets its ordinal.
  const bool fp_here = fp_on_ && ordinal;
  const uint64_t fp = fp_here ? plan_point(inputs, sizes, alias_of, inplace_of) : 0;
  const int op_id = new_op(inputs, sizes, alias_of, cost);
  if (fp_here) {
    ops_[op_id].ordinal = ordinal_++;
    plan_op_.push_back(op_id);
    if (fp_keep_) fps_.push_back(fp);
  }
  Op& op = ops_[op_id];
  op.inplace_of.assign(sizes.size(), -1);
  for (size_t i = 0; i < inplace_of.size() && i < sizes.size(); ++i) {
    int j = inplace_of[i];
    if (j < 0) continue;
    if (j >= int(inputs.size()) || alias_of[i] >= 0) throw std::invalid_argument("bad in-place output");
    op.inplace_of[i] = j;
    // The room the write does not need: the buffer of each storage it
    // overwrites, once (two written tensors of one storage make two new
    // versions but free one buffer), and none of a pinned one (end_call
    // keeps it).
    const int so = tensors_[inputs[j]].storage;
    bool counted = storages_[so].pinned;
    for (size_t k = 0; k < i && !counted; ++k)
      counted = op.inplace_of[k] >= 0 && tensors_[inputs[op.inplace_of[k]]].storage == so;
    if (!counted) op.inplace_bytes += std::min(op.sizes[i], storages_[so].size);
  }
  for (int t : op.outputs) {
    tensors_[t].refs += 1;
    storages_[tensors_[t].storage].refs += 1;
  }
  if (op.outputs.empty()) {  // runs (and costs) once; its inputs must be there together
    touch_parents(op_id);
    lock_inputs(op_id);
    return op_id;
  }
  current_op_ = op_id;  // (for an out-of-memory report)
  try {
    materialize(op.outputs[0], /*remat=*/false, /*stop_before_root=*/true);
  } catch (...) {  // the op will not run: materialize gave its locks back; its outputs are dropped
    current_op_ = -1;
    drop_outputs(op_id);
    throw;
  }
  current_op_ = -1;
  return op_id;
}

// Note [Changing an op's cost]
// An op's cost enters the core's state in four places: op.cost, the cached
// cost of each storage it has an output on (the sum over the storage's ops),
// the value of the eqclass component of such a storage while it is evicted
// (the sum of its members' costs; after_remat and drop_garbage subtract the
// cost a member has when it leaves, so the component must see every change
// made while it is a member), and the cached e* costs (Full mode) of the
// resident storages joined to an evicted one through evicted storages.
// change_cost() updates all four. end_call() uses it for the op in progress,
// whose output storages are not computed yet (no component node; compute()
// dirties their e* frontier right after), and set_cost() for a finished op,
// whose cost a driver measured later (CUDA events resolve after the op ran).
// What already happened is not rewritten: the clock, and so the staleness of
// every storage, advanced by the cost the op had when it (or a recomputation
// of it) ran, and so did remat_compute; only base_compute, the total cost of
// first computations, is corrected, since each finished op was counted in it
// exactly once.

double Core::change_cost(int op_id, double cost, bool in_progress) {
  Op& op = ops_.at(op_id);
  if (!(cost >= 0) || !std::isfinite(cost)) throw std::invalid_argument("cost must be finite and >= 0");
  if (cost == op.cost) return 0.0;
  const double delta = cost - op.cost;
  op.cost = cost;
  note_cost(cost, op.outputs.size());
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    const int sid = tensors_[op.outputs[i]].storage;
    bool seen = false;  // (each storage once; outputs are few, and this runs for every op)
    for (size_t j = 0; j < i && !seen; ++j) seen = tensors_[op.outputs[j]].storage == sid;
    if (seen) continue;
    Storage& s = storages_[sid];
    s.cost += delta;
    s.full_dirty = true;
    if (s.uf >= 0) uf_[uf_find(s.uf)].value += delta;
    if (s.uf >= 0 && delta < 0) bt_walk(uf_find(s.uf));
    bt_touch_nbrs(sid);
    if (!in_progress && cfg_.cost == CostMode::Full && !s.resident && !s.banished) dirty_frontier(sid);
  }
  return delta;
}

void Core::set_cost(int op_id, double cost) {
  if (op_id < 0 || op_id >= int(ops_.size())) throw std::invalid_argument("unknown op " + std::to_string(op_id));
  if (!ops_[op_id].ended) throw std::invalid_argument("op " + std::to_string(op_id) + " has not ended");
  c_.base_compute += change_cost(op_id, cost, /*in_progress=*/false);
}

void Core::end_call(int op_id, double cost) {
  Op& op = ops_.at(op_id);
  change_cost(op_id, cost, /*in_progress=*/true);
  op.ended = true;
  if (op.outputs.empty()) {  // it runs once (never again: nothing can need it) and is reported like any op
    if (on_compute && compute_hook_first) on_compute(op_id, /*remat=*/false);
    clock_ += op.cost;
    c_.base_compute += op.cost;
    for (int p : op.inputs) unlock(tensors_[p].storage);
    for (int p : op.inputs)
      if (storages_[tensors_[p].storage].banish_pending) try_banish(tensors_[p].storage);
    return;
  }
  if (std::any_of(op.inplace_of.begin(), op.inplace_of.end(), [](int j) { return j >= 0; })) {  // even of 0 bytes
    // In place: the inputs are released first, then each overwritten version
    // hands its references and its bytes over to the new one.
    for (int p : op.inputs) unlock(tensors_[p].storage);
    for (size_t i = 0; i < op.outputs.size(); ++i) {
      int j = op.inplace_of[i];
      if (j < 0) continue;
      Tensor& old = tensors_[op.inputs[j]];
      Tensor& fresh = tensors_[op.outputs[i]];
      const int64_t moved = old.refs;
      Storage& so = storages_[old.storage];
      Storage& sn = storages_[fresh.storage];
      sn.refs += moved - fresh.refs;
      fresh.refs = moved;
      so.refs -= moved;
      old.refs = 0;
      if (so.resident && !so.pinned && so.locks == 0) evict(old.storage, /*by_heuristic=*/false);
    }
    compute(op.outputs[0], /*remat=*/false);
    for (int p : op.inputs)
      if (storages_[tensors_[p].storage].banish_pending) try_banish(tensors_[p].storage);
    for (int t : op.outputs) {
      storages_[tensors_[t].storage].last_access = clock_;
      bt_touch(tensors_[t].storage);
    }
    return;
  }
  compute(op.outputs[0], /*remat=*/false);
  finish(op_id);
  for (int t : op.outputs) {
    storages_[tensors_[t].storage].last_access = clock_;
    bt_touch(tensors_[t].storage);
  }
}

// Note [Ops without outputs]
// An op without outputs (an in-place write of a constant, a view nobody
// keeps) is never recomputed, so begin_call does not materialize an output
// for it: it only brings the inputs back. They must be resident *together*
// when it runs, as for any op (Note [Rematerialization order and the explicit
// stack]): the defined ones are locked first, then each missing one is
// locked as soon as it is back, so that bringing back the next one cannot
// evict it; end_call (or abort_call) unlocks them. If bringing one back
// fails, the locks taken so far are released before the error propagates.
void Core::lock_inputs(int op_id) {
  // (A copy of the inputs, since bringing one back adds ops and may move ops_; on the stack for an op of
  // a few inputs: this runs for every op without outputs, each view among them.)
  constexpr size_t kSmall = 8;
  const size_t n = ops_[op_id].inputs.size();
  int small_inputs[kSmall], small_locked[kSmall];
  std::vector<int> big;
  int* inputs = small_inputs;
  int* locked = small_locked;  // one entry per lock taken
  if (n > kSmall) {
    big.resize(2 * n);
    inputs = big.data();
    locked = big.data() + n;
  }
  std::copy(ops_[op_id].inputs.begin(), ops_[op_id].inputs.end(), inputs);
  size_t n_locked = 0, n_pending = 0;
  try {
    for (size_t i = 0; i < n; ++i) {
      const int u = inputs[i];
      if (!tensors_[u].defined) {
        inputs[n_pending++] = u;  // (the pending ones, in order, over the entries already read)
        continue;
      }
      lock(tensors_[u].storage);
      locked[n_locked++] = tensors_[u].storage;
    }
    for (size_t i = 0; i < n_pending; ++i) {
      const int u = inputs[i];
      require(u);  // a no-op when bringing back an earlier one brought it back too
      lock(tensors_[u].storage);
      locked[n_locked++] = tensors_[u].storage;
    }
  } catch (...) {
    for (size_t i = 0; i < n_locked; ++i) unlock(locked[i]);
    throw;
  }
}

void Core::abort_call(int op_id) {
  Op& op = ops_.at(op_id);
  for (int p : op.inputs) unlock(tensors_[p].storage);
  drop_outputs(op_id);
}

void Core::drop_outputs(int op_id) {
  for (int t : ops_[op_id].outputs) {
    Tensor& x = tensors_[t];
    Storage& s = storages_[x.storage];
    s.refs -= x.refs;
    x.refs = 0;
    if (!s.resident && s.root == t) s.banished = true;  // never computed
  }
}

std::vector<int> Core::mutate_inplace(const std::vector<int>& inputs, const std::vector<int>& mutated, double cost) {
  return call_inplace(inputs, {}, {}, mutated, cost);
}

std::vector<int> Core::call_inplace(const std::vector<int>& inputs, const std::vector<int64_t>& sizes_in,
                                    const std::vector<int>& alias_in, const std::vector<int>& mutated, double cost) {
  std::vector<int64_t> sizes = sizes_in;
  std::vector<int> alias_of = alias_in, inplace_of(sizes_in.size(), -1), which;
  const int plain = int(sizes_in.size());
  // Protecting a written constant can pin another written input (one computed
  // from it): protect until no written storage is newly pinned, then every
  // pinned one is written as a constant (keeping its buffer).
  std::vector<char> protected_(mutated.size(), 0);
  for (bool again = true; again;) {
    again = false;
    for (size_t k = 0; k < mutated.size(); ++k) {
      const int j = mutated[k];
      if (j < 0 || j >= int(inputs.size())) throw std::invalid_argument("mutated index out of range");
      const int sid = tensors_.at(inputs[j]).storage;
      if (storages_[sid].pinned && !protected_[k]) {
        protect(sid);
        protected_[k] = 1;
        again = true;
      }
    }
  }
  for (int j : mutated) {
    const int sid = tensors_[inputs[j]].storage;
    if (storages_[sid].pinned) {
      which.push_back(-1);
      continue;
    }
    which.push_back(int(sizes.size()));
    sizes.push_back(storages_[sid].size);
    alias_of.push_back(-1);
    inplace_of.push_back(j);
  }
  const int op_id = begin_call(inputs, sizes, alias_of, inplace_of, cost);
  end_call(op_id, cost);
  const std::vector<int>& outs = ops_[op_id].outputs;
  std::vector<int> out(outs.begin(), outs.begin() + plain);
  for (int k : which) out.push_back(k < 0 ? -1 : outs[k]);
  return out;
}

std::vector<int> Core::mutate(const std::vector<int>& inputs, const std::vector<int>& mutated, double cost) {
  std::vector<int64_t> sizes;
  std::vector<int> alias_of;
  for (int j : mutated) {
    if (j < 0 || j >= int(inputs.size())) throw std::invalid_argument("mutated index out of range");
    sizes.push_back(storages_[tensors_[inputs[j]].storage].size);
    alias_of.push_back(-1);
  }
  std::vector<int> outs = call(inputs, sizes, alias_of, cost);
  for (int j : mutated) release(inputs[j]);
  return outs;
}

// ---------------------------------------------------------------------------
// References and locks

void Core::check_alive_input(int t, const char* what) const {
  if (storages_[tensors_.at(t).storage].collected)
    throw std::logic_error(std::string(what) + " of collected tensor " + std::to_string(t));
}

void Core::retain(int t) {
  check_alive_input(t, "retain");
  Tensor& x = tensors_.at(t);
  x.refs += 1;
  storages_[x.storage].refs += 1;
}

void Core::release(int t) {
  Tensor& x = tensors_.at(t);
  if (x.refs <= 0) throw std::logic_error("release of tensor " + std::to_string(t) + " with no references");
  x.refs -= 1;
  const int sid = x.storage;
  Storage& s = storages_[sid];
  s.refs -= 1;
  if (s.refs > 0) return;
  if (s.pinned && cfg_.semantics.free_dead_constants && s.size > 0) {
    // The program dropped a constant (e.g. an old gradient): keep what still
    // needs its value, then free it for good. (One of no bytes just stays.)
    protect(sid);
    Storage& c = storages_[sid];
    if (c.locks == 1 && c.refs == 0) {
      c.pinned = false;
      c.locks = 0;
      c.resident = false;
      c_.memory -= c.size;
      for (int t2 : c.tensors) tensors_[t2].defined = false;
      c.banished = true;
      c_.eager_evictions += 1;
      if (on_evict) on_evict(sid, false);
    }
    return;
  }
  if (cfg_.banish) {
    try_banish(sid);
  } else if (s.resident && !s.pinned) {
    if (s.locks > 0) s.evict_on_unlock = true;  // in use by a (re)computation right now
    else if (cfg_.semantics.keep_needed) free_if_unneeded(sid);
    else evict(sid, /*by_heuristic=*/false);
  }
  if (cfg_.semantics.keep_needed && !s.resident && !s.banished) {
    // An evicted tensor nobody references: what was kept for it may go now.
    const std::vector<int> deps = storages_[sid].deps;
    for (int d : deps) free_if_unneeded(d);
  }
}

// Note [Freeing what an evicted tensor needs]
// Eager eviction frees a storage when its last reference dies. If a storage
// that depends on it was evicted earlier (while this one was still alive, so
// evicting it looked cheap), freeing it silently turns that cheap eviction
// into an expensive one: bringing the dependent back now means recomputing
// this storage too, and, in a backward pass, the chain of gradients behind it.
// In an LSTM's backward at half its peak this made every step recompute the
// whole backward so far. With Config::keep_needed a released storage that an
// evicted, still referenced storage depends on stays resident (refs 0, in the
// pool, so the heuristic can still evict it at its true cost); it is freed as
// soon as nothing evicted and referenced needs it: when its last such
// dependent comes back (at the unlock after that recomputation) or is
// released. A rematerialized storage nobody references is freed the same way
// once its dependents are back, instead of staying resident until the
// heuristic finds it.

bool Core::needed_by_evicted(int sid) const {
  for (int d : storages_[sid].dependents) {
    const Storage& ds = storages_[d];
    if (!ds.resident && !ds.banished && (ds.refs > 0 || ds.wanted > 0)) return true;
  }
  return false;
}

void Core::free_if_unneeded(int sid) {
  Storage& s = storages_[sid];
  // (wanted: one of its tensors is being rematerialized right now; need: a planned recomputation will read
  // it, Note [Planned recomputation] in core_materialize.cpp.)
  if (s.refs > 0 || s.wanted > 0 || s.need > 0 || !s.resident || s.pinned || s.locks > 0 || s.banished) return;
  if (!needed_by_evicted(sid)) evict(sid, /*by_heuristic=*/false);
}

void Core::forget(int sid) {
  Storage& s = storages_.at(sid);
  if (s.refs > 0 || s.locks > 0 || s.pinned) throw std::logic_error("forget of a storage in use " + std::to_string(sid));
  if (s.resident) evict(sid, /*by_heuristic=*/false);
}

void Core::lock(int sid) {
  Storage& s = storages_.at(sid);
  if (!s.resident) throw std::logic_error("cannot lock evicted storage " + std::to_string(sid));
  if (s.locks == 0) pool_remove(sid);
  s.locks += 1;
}

void Core::unlock(int sid) {
  Storage& s = storages_.at(sid);
  if (s.locks <= 0) throw std::logic_error("unlock of unlocked storage " + std::to_string(sid));
  s.locks -= 1;
  if (s.locks > 0) return;
  if (s.evict_on_unlock && s.refs == 0 && s.resident && !s.pinned &&
      !(s.need > 0 && cfg_.semantics.keep_needed)) {  // (a planned read keeps it: free_if_unneeded decides later)
    s.evict_on_unlock = false;
    evict(sid, /*by_heuristic=*/false);
    return;
  }
  s.evict_on_unlock = false;
  pool_add(sid);
  if (cfg_.semantics.keep_needed && !cfg_.banish) free_if_unneeded(sid);
}

}  // namespace dtr
