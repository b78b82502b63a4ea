// core.cpp - the DTR eviction core (see core.h for the model and invariants).
#include "core.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace dtr {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

template <class T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}
}  // namespace

Core::Core(const Config& cfg) : cfg_(cfg), rng_(cfg.seed) {}

// ---------------------------------------------------------------------------
// Graph construction

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
      if (cfg_.eqclass_split && s.uf >= 0) uf_[uf_find(s.uf)].value += cost;
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
      if (cfg_.eqclass_split && s.uf >= 0 && storages_[su].uf >= 0) uf_merge(s.uf, storages_[su].uf);
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
  std::vector<int> outs = call({}, {size}, {-1}, 0.0);
  int t = outs[0];
  Storage& s = storages_[tensors_[t].storage];
  c_.constant_bytes += s.size;
  lock(tensors_[t].storage);
  s.pinned = true;
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
  const int op_id = new_op(inputs, sizes, alias_of, cost);
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
  try {
    materialize(op.outputs[0], /*remat=*/false, /*stop_before_root=*/true);
  } catch (...) {  // the op will not run: materialize gave its locks back; its outputs are dropped
    drop_outputs(op_id);
    throw;
  }
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
  std::vector<int> seen;
  for (int t : op.outputs) {
    const int sid = tensors_[t].storage;
    if (contains(seen, sid)) continue;
    seen.push_back(sid);
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
    if (on_compute) on_compute(op_id, /*remat=*/false);
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
  finish(op_id, /*remat=*/false);
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
  const std::vector<int> inputs = ops_[op_id].inputs;
  std::vector<int> locked, pending;  // one entry per lock taken
  try {
    for (int u : inputs) {
      if (!tensors_[u].defined) {
        pending.push_back(u);
        continue;
      }
      lock(tensors_[u].storage);
      locked.push_back(tensors_[u].storage);
    }
    for (int u : pending) {
      require(u);  // a no-op when bringing back an earlier one brought it back too
      lock(tensors_[u].storage);
      locked.push_back(tensors_[u].storage);
    }
  } catch (...) {
    for (int s : locked) unlock(s);
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

// Note [Collection and compaction]
// The graph only grows as a program runs, so a long run (many training steps
// in one budget) needs it garbage-collected, in two stages.
//
// collect() finds what can never be needed again. A storage is *needed* if
// it is referenced (and not banished) or locked, or if a needed storage that
// may be recomputed (not banished, and either not pinned or with an undefined
// view) depends on it. A banished storage keeps nothing: it is never recomputed (a
// recomputation of its op for a sibling frees it at once, and that sibling's
// storage has the same dependencies). Walking through one would also make the
// result depend on compaction, which drops the edges to collected storages
// (all banished): a core that never compacted kept, through them, storages
// that a compacted one collected. Everything else is
// *collected*: never referenced again (a driver only passes referenced
// tensors as inputs), so never needed again either (collection is
// monotone). A collected storage is put in one canonical state: freed if it
// was resident (it only took room), banished, and taken out of its evicted
// neighbourhood (its node leaves the union-find component, whose value loses
// its cost, as when a storage is rematerialized). In that state nothing the
// core does with the storages still in use looks at it: the eqclass and e*
// neighbourhoods skip banished and node-less storages, protect() and
// banishing skip banished ones, and no recomputation reads it. An op is
// collected once it can never run again: every output is on a storage that is
// not needed, on a banished one (a recomputation frees it at once), or is a
// defined tensor of a pinned storage (a constant is never recomputed), so a
// driver may drop its recipe. A storage that is not needed
// is collected, except a dead constant that keeps its bytes (one that is not
// referenced, without free_dead_constants: simrd keeps constants resident).
// The tensors of such a constant are never required again, and nothing that
// may be recomputed reads them; so an undefined view on it (the constant came
// back through its root, e.g. when protect() pinned it) is not recomputed
// either, and its op is collected too: check() allows a collected op an
// undefined output on a pinned storage if it is unreferenced and read by no
// op that is not collected.
//
// compact() then drops the collected storages with their tensors, and the
// collected ops, and renumbers the rest in order. A collected storage is kept
// while an op that is still kept has an output on it (an op with several
// outputs, one still needed), and a collected op is kept while one of its
// outputs is kept (the constant's op: tensors name their op); the kept set is
// closed over both relations. A kept collected op never runs again, so its
// inputs that were dropped read -1. Edges to dropped storages are removed.
// The union-find is rebuilt from the kept evicted storages, one node each:
// the storages that shared a root share a new root carrying the old root's
// value, so every component keeps its value (including what storages since
// dropped or rematerialized contributed) and every later score is what it
// would have been without compaction; only `storage_accesses` (path lengths)
// differs. The pool keeps its order. A driver remaps its ids with the maps
// compact() returns; the runtime compacts once more than half of the core's
// storages (or ops) were collected since the last compaction, which keeps the tables
// within a constant factor of what is live, at amortized O(1) per op.

std::pair<std::vector<int>, std::vector<int>> Core::collect() {
  const uint64_t mark = ++stamp_;
  // A pinned storage is never recomputed, but an undefined view on it (its
  // storage came back through another op) still is, by rerunning its op. A
  // banished one (a collected one too) is not: it keeps nothing.
  auto may_recompute = [&](const Storage& st) {
    if (st.banished) return false;
    if (!st.pinned) return true;
    for (int t : st.tensors)
      if (!tensors_[t].defined) return true;
    return false;
  };
  std::vector<int> stack;
  for (size_t s = 0; s < storages_.size(); ++s) {
    Storage& st = storages_[s];
    if (st.collected) continue;
    if ((st.refs > 0 && !st.banished) || st.locks > (st.pinned ? 1 : 0)) {
      st.mark = mark;                                   // referenced: kept
      if (may_recompute(st)) stack.push_back(int(s));  // and keeps its dependencies
    }
  }
  while (!stack.empty()) {  // a storage that may be recomputed needs its dependencies
    int s = stack.back();
    stack.pop_back();
    for (int d : storages_[s].deps) {
      Storage& ds = storages_[d];
      if (ds.mark == mark) continue;
      ds.mark = mark;
      if (may_recompute(ds)) stack.push_back(d);
    }
  }
  // Freeing garbage may walk the graph (dirty_frontier), which reuses the stamps.
  std::vector<char> marked(storages_.size());
  for (size_t s = 0; s < storages_.size(); ++s) marked[s] = storages_[s].mark == mark;
  std::pair<std::vector<int>, std::vector<int>> out;
  std::vector<int> leaving;  // evicted storages leaving their components (split all at once)
  for (size_t s = 0; s < storages_.size(); ++s) {
    const Storage& st = storages_[s];
    if (st.collected || marked[s]) continue;
    if (st.pinned) {
      // A dropped constant of no bytes stays pinned while anything may need it
      // (see release()); once nothing can, it is garbage like any other.
      if (st.size != 0 || st.refs > 0 || st.locks != 1) continue;
      storages_[s].pinned = false;
      storages_[s].locks = 0;
    }
    drop_garbage(int(s), cfg_.eqclass_split ? &leaving : nullptr);
    out.second.push_back(int(s));
  }
  uf_leave_all(leaving);
  for (size_t o = 0; o < ops_.size(); ++o) {
    Op& op = ops_[o];
    if (op.collected) continue;
    bool needed = false;
    for (int t : op.outputs) {
      const Tensor& x = tensors_[t];
      const Storage& s = storages_[x.storage];
      // (A banished output is never kept: an op runs again only for the others.)
      needed = needed || (marked[x.storage] && !s.banished && !(s.pinned && x.defined));
    }
    if (needed) continue;
    op.collected = true;
    out.first.push_back(int(o));
  }
  return out;
}

void Core::drop_garbage(int sid, std::vector<int>* leaving) {
  Storage& s = storages_[sid];
  s.collected = true;
  num_collected_ += 1;
  s.banish_pending = false;
  s.evict_on_unlock = false;
  const bool was_resident = s.resident;
  if (s.resident) {
    s.resident = false;
    c_.memory -= s.size;
    pool_remove(sid);
    for (int t : s.tensors) tensors_[t].defined = false;
    c_.eager_evictions += 1;
  } else if (s.uf >= 0) {
    if (leaving) leaving->push_back(sid);  // the caller splits its component
    else uf_leave(sid);
  }
  s.banished = true;
  if (cfg_.cost == CostMode::Full) dirty_frontier(sid);
  if (was_resident && on_evict) on_evict(sid, false);
}

int Core::uf_root(int n) const {
  while (uf_[n].parent != n) n = uf_[n].parent;
  return n;
}

Core::Remap Core::compact() {
  const int nops = int(ops_.size()), nts = int(tensors_.size()), nss = int(storages_.size());
  // The kept set: what is not collected, closed over "a kept storage keeps
  // the ops with an output on it" and "a kept op keeps its outputs' storages".
  std::vector<char> keep_o(nops, 0), keep_s(nss, 0);
  std::vector<int> work;
  auto keep_storage = [&](int s) {
    if (keep_s[s]) return;
    keep_s[s] = 1;
    work.push_back(s);
  };
  auto keep_op = [&](int o) {
    if (keep_o[o]) return;
    keep_o[o] = 1;
    for (int t : ops_[o].outputs) keep_storage(tensors_[t].storage);
  };
  for (int s = 0; s < nss; ++s)
    if (!storages_[s].collected) keep_storage(s);
  for (int o = 0; o < nops; ++o)
    if (!ops_[o].collected) keep_op(o);
  while (!work.empty()) {
    const int s = work.back();
    work.pop_back();
    for (int o : storages_[s].ops) keep_op(o);
  }

  Remap r;
  r.ops.assign(nops, -1);
  r.tensors.assign(nts, -1);
  r.storages.assign(nss, -1);
  int n = 0;
  for (int o = 0; o < nops; ++o)
    if (keep_o[o]) r.ops[o] = n++;
  const int new_ops = n;
  n = 0;
  for (int s = 0; s < nss; ++s)
    if (keep_s[s]) r.storages[s] = n++;
  const int new_storages = n;
  n = 0;
  for (int t = 0; t < nts; ++t)
    if (keep_s[tensors_[t].storage]) r.tensors[t] = n++;
  const int new_tensors = n;

  std::vector<Op> ops;
  ops.reserve(new_ops);
  for (int o = 0; o < nops; ++o) {
    if (!keep_o[o]) continue;
    Op op = std::move(ops_[o]);
    for (int& u : op.inputs) u = u >= 0 ? r.tensors[u] : -1;
    for (int& t : op.outputs) t = r.tensors[t];
    ops.push_back(std::move(op));
  }
  std::vector<Tensor> tensors;
  tensors.reserve(new_tensors);
  for (int t = 0; t < nts; ++t) {
    if (r.tensors[t] < 0) continue;
    Tensor x = tensors_[t];
    x.storage = r.storages[x.storage];
    x.op = r.ops[x.op];
    tensors.push_back(x);
  }
  // The union-find: one node per kept evicted storage (see the Note).
  std::vector<UFNode> uf;
  std::vector<int> new_root(uf_.size(), -1);
  std::vector<Storage> storages;
  storages.reserve(new_storages);
  auto remap_ids = [](std::vector<int>& ids, const std::vector<int>& m) {
    size_t k = 0;
    for (int id : ids)
      if (m[id] >= 0) ids[k++] = m[id];
    ids.resize(k);
  };
  for (int s = 0; s < nss; ++s) {
    if (!keep_s[s]) continue;
    Storage st = std::move(storages_[s]);
    st.root = r.tensors[st.root];
    remap_ids(st.tensors, r.tensors);
    remap_ids(st.ops, r.ops);
    remap_ids(st.deps, r.storages);
    remap_ids(st.dependents, r.storages);
    if (st.uf >= 0) {
      const int root = uf_root(st.uf);
      const int node = int(uf.size());
      if (new_root[root] < 0) {
        new_root[root] = node;
        uf.push_back(UFNode{node, uf_[root].value});
      } else {
        uf.push_back(UFNode{new_root[root], 0.0});
      }
      st.uf = node;
    }
    storages.push_back(std::move(st));
  }
  ops_ = std::move(ops);
  tensors_ = std::move(tensors);
  storages_ = std::move(storages);
  uf_ = std::move(uf);
  for (int& s : pool_) s = r.storages[s];
  if (bt_on_) {  // ids changed: the next choice builds the tree again
    bt_on_ = false;
    for (Storage& st : storages_) st.bt_slot = -1, st.bt_dirty = false;
    bt_dirty_.clear();
    bt_sid_.clear(), bt_k_.clear(), bt_p_.clear(), bt_m_.clear(), bt_a_.clear();
    uf_front_.clear();
    bt_cap_ = bt_used_ = 0;
  }
  num_collected_ = 0;
  for (Storage& st : storages_) {
    num_collected_ += st.collected;
    st.uf_nbrs = 0;
    for (int d : st.deps) st.uf_nbrs += storages_[d].uf >= 0;
    for (int d : st.dependents) st.uf_nbrs += storages_[d].uf >= 0;
  }
  return r;
}

// Note [Protecting a constant]
// Before a constant C is overwritten in place (or freed: free_dead_constants),
// nothing that may still be computed may need C's old value. protect(C) walks
// the storages computed from C and, for each one still referenced, makes its
// referenced tensors defined and pins the storage, so that none of them is
// recomputed again. The walk stops at a constant none of whose tensors is
// undefined (its tensors stay as they are), but not at a constant with an
// undefined tensor: that tensor (a view, as the storage came back through
// its root) is recomputed by rerunning its op, which reads that op's inputs,
// not only the storage it views (as in try_banish() and collect()). So pinning
// a target's root is not enough either: a referenced view of it that is
// undefined is brought back too, while C still holds its old value. Otherwise
// requiring that view later recomputes from C's new value (a wrong result),
// or, once a dead constant was freed, reaches its banished storage (which
// cannot be locked). The walk is storage-level, like the rest of the core: it
// may bring back a view whose op does not read C.

std::vector<int> Core::protect_targets(int sid) {
  // Walk the storages computed from `sid` (not through constants all of whose
  // tensors are defined; see Note [Protecting a constant]): every one still
  // referenced must not need `sid`'s old value again. A storage of no
  // bytes loses no value when it goes (and is never freed: see release()):
  // pinning what was computed from it pinned, in Hugging Face's GPT-2, every
  // activation downstream of its KV cache, which starts as an empty tensor.
  std::vector<int> live;
  if (storages_.at(sid).size == 0) return live;
  std::vector<int> stack(storages_[sid].dependents);
  const uint64_t mark = ++stamp_;
  auto complete = [&](const Storage& s) {
    for (int t : s.tensors)
      if (!tensors_[t].defined) return false;
    return true;
  };
  while (!stack.empty()) {
    int d = stack.back();
    stack.pop_back();
    Storage& s = storages_[d];
    if (s.mark == mark || s.banished || (s.pinned && complete(s))) continue;
    s.mark = mark;
    if (s.refs > 0) live.push_back(d);
    for (int n : s.dependents) stack.push_back(n);
  }
  return live;
}

void Core::protect(int sid) {
  for (int d : protect_targets(sid)) {
    if (!storages_[d].pinned) pin(storages_[d].root);
    const std::vector<int> tensors = storages_[d].tensors;
    for (int t : tensors)
      if (tensors_[t].refs > 0 && !tensors_[t].defined) require(t);
  }
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
  if (s.pinned && cfg_.free_dead_constants && s.size > 0) {
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
  } else if (cfg_.eager_evict && s.resident && !s.pinned) {
    if (s.locks > 0) s.evict_on_unlock = true;  // in use by a (re)computation right now
    else if (cfg_.keep_needed) free_if_unneeded(sid);
    else evict(sid, /*by_heuristic=*/false);
  }
  if (cfg_.keep_needed && !s.resident && !s.banished) {
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
  // (wanted: one of its tensors is being rematerialized right now.)
  if (s.refs > 0 || s.wanted > 0 || !s.resident || s.pinned || s.locks > 0 || s.banished) return;
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
  if (s.evict_on_unlock && s.refs == 0 && s.resident && !s.pinned) {
    s.evict_on_unlock = false;
    evict(sid, /*by_heuristic=*/false);
    return;
  }
  s.evict_on_unlock = false;
  pool_add(sid);
  if (cfg_.keep_needed && cfg_.eager_evict && !cfg_.banish) free_if_unneeded(sid);
}

void Core::require(int t) {
  check_alive_input(t, "require");
  if (!tensors_.at(t).defined) materialize(t, /*remat=*/true);
}

void Core::pin(int t) {
  require(t);
  Storage& s = storages_[tensors_[t].storage];
  if (s.pinned) return;
  lock(tensors_[t].storage);
  s.pinned = true;
  if (on_pin) on_pin(tensors_[t].storage);
}

// ---------------------------------------------------------------------------
// (Re)materialization
//
// Note [Rematerialization order and the explicit stack]
// To materialize tensor t (simrd section 4.4): stamp the access time of all
// its inputs' storages, lock the inputs that are defined, then rematerialize
// the undefined ones in input order (each is locked once it is back), make room
// for the outputs, compute, and unlock the inputs. Chains of evicted tensors
// can be arbitrarily long (100k in tests), so the recursion is an explicit
// stack of frames rather than C++ recursion.

void Core::touch_parents(int op_id) {
  for (int p : ops_[op_id].inputs) {
    storages_[tensors_[p].storage].last_access = clock_;
    bt_touch(tensors_[p].storage);
  }
}

// Note [Deepest input first]
// A frame holds every input it already has (locked) while it recomputes the
// next pending one, so the order of the pending inputs decides how much is
// held during a deep recursion. In a Python-loop LSTM, the gates of step t are
// add(x_t @ W_x, h_{t-1} @ W_h): in input order the x projection (cheap, from
// constants) comes back first and stays locked while the recursion walks back
// through h_{t-1}, h_{t-2}, ... -- one such buffer per level, seven of them
// (896 KiB of a 1.24 MiB budget) in tests/test_runtime_models.py's LSTM at 35%,
// where the budget then ran out. As in Sethi-Ullman register allocation, the
// input whose recomputation needs the most should come first. With
// Config::deep_first (the runtime's semantics, recorded in its logs' meta
// line), pending inputs whose own op has an evicted input (recomputing them
// recurses) go before those computable at once, input order kept within each
// group (a stable partition: O(inputs of the pending inputs), no search of
// the graph). simrd recomputes in input order (its section 4.4); replays of
// its logs keep that.
bool Core::needs_recursion(int t) const {
  for (int p : ops_[tensors_[t].op].inputs)
    if (!tensors_[p].defined) return true;
  return false;
}

void Core::materialize(int t0, bool remat0, bool stop_before_root) {
  struct Frame {
    int t;
    bool remat;
    std::vector<int> pending;  // inputs that were undefined when the frame began
    size_t i;
    bool waiting;              // the child for pending[i] is on the stack
    bool released = false;     // finish() gave its locks back
  };
  std::vector<Frame> stack;
  auto begin = [&](int t, bool remat) {
    const Op& op = ops_[tensors_[t].op];
    if (op.collected) throw std::logic_error("recomputing collected op " + std::to_string(tensors_[t].op));
    touch_parents(tensors_[t].op);
    storages_[tensors_[t].storage].wanted += 1;
    Frame f{t, remat, {}, 0, false};
    for (int p : op.inputs)
      if (tensors_[p].defined) lock(tensors_[p].storage);
    for (int p : op.inputs)
      if (!tensors_[p].defined) f.pending.push_back(p);
    if (cfg_.deep_first && f.pending.size() > 1)
      std::stable_partition(f.pending.begin(), f.pending.end(), [&](int p) { return needs_recursion(p); });
    stack.push_back(std::move(f));
  };
  begin(t0, remat0);
  try {
    while (!stack.empty()) {
      Frame& f = stack.back();
      if (f.waiting) {  // pending[i] has just been rematerialized
        lock(tensors_[f.pending[f.i]].storage);
        f.waiting = false;
        ++f.i;
        continue;
      }
      if (f.i < f.pending.size()) {
        int p = f.pending[f.i];
        if (tensors_[p].defined) {  // a sibling's recomputation brought it back
          lock(tensors_[p].storage);
          ++f.i;
        } else {
          f.waiting = true;
          begin(p, true);  // invalidates f
        }
        continue;
      }
      const int t = f.t;
      const bool remat = f.remat;
      const int op_id = tensors_[t].op;
      if (stop_before_root && stack.size() == 1) {  // begin_call: the driver runs the op itself
        // (room first, with the frame still on the stack: if there is none, the catch below gives
        // its locks back)
        make_room(ops_[op_id].total_size - ops_[op_id].inplace_bytes);
        stack.pop_back();
        storages_[tensors_[t].storage].wanted -= 1;
        return;
      }
      const int64_t handed = remat ? mark_handover(op_id) : 0;
      make_room(ops_[op_id].total_size - handed);
      compute(t, remat);
      stack.back().released = true;
      finish(op_id, remat);  // (still wanted here: its unlocks must not free what it just computed)
      stack.pop_back();
      storages_[tensors_[t].storage].wanted -= 1;
    }
  } catch (...) {  // out of memory, thrashing or a failed recomputation: the frames are abandoned
    // An old version handed over to a recomputation that did not finish lost its bytes (the driver
    // moved them, and the op may have written them): it is evicted below, to be recomputed if needed.
    std::vector<int> lost;
    for (const Frame& f : stack)
      for (int p : ops_[tensors_[f.t].op].inputs) {
        Storage& s = storages_[tensors_[p].storage];
        if (s.handed) lost.push_back(tensors_[p].storage);
        s.handed = false;  // (before any unlock below can evict it: its bytes count as its own again)
      }
    // Each frame gives back the locks it took (finish() gave back its own already): the inputs that
    // were defined when it began, and the pending ones that came back since.
    for (auto it = stack.rbegin(); it != stack.rend(); ++it) {
      const Frame& f = *it;
      storages_[tensors_[f.t].storage].wanted -= 1;
      if (f.released) continue;
      std::vector<int> pend(f.pending);
      for (int p : ops_[tensors_[f.t].op].inputs) {
        auto u = std::find(pend.begin(), pend.end(), p);
        if (u != pend.end()) pend.erase(u); else unlock(tensors_[p].storage);
      }
      for (size_t k = 0; k < f.i; ++k) unlock(tensors_[f.pending[k]].storage);
    }
    for (int sid : lost) {
      const Storage& s = storages_[sid];
      if (s.resident && s.locks == 0 && !s.pinned) evict(sid, /*by_heuristic=*/false);
    }
    throw;
  }
}

// Note [Handing bytes over on recomputation]
// The first run of an in-place write (x.relu_(), a dropout mask's div_) hands
// the old version's bytes over to the new one (end_call). A recomputation
// used to run it out of place: the old version came back, the new one was
// allocated next to it and filled with a copy, and the old one stayed resident
// until evicted, so recomputing a 16 MiB dropout mask took two buffers and a
// copy where its first run took one. With Config::inplace_handover (the
// runtime's semantics, recorded in its logs' meta line), a recomputation
// hands over too, whenever nothing else can read the old version afterwards:
// the program holds no reference to it (refs == 0), it is not pinned, and the
// only lock on it is this op's single read of it (so no pending
// recomputation needs it, and the op reads it once: as the buffer it
// writes). Then room is made for the outputs less the handed bytes, the
// memory counter grows by the same amount, and the old version is evicted
// right after the op (finish), freeing nothing: its bytes are the new
// version's. The driver sees Core::handed(s) during on_compute and moves the
// buffer instead of copying it; a replay's trace reports the free before the
// op, which is how a static schedule says "handed over" (Note [In-place writes
// in a schedule] in dtr.sim.schedule). An old version needed later is
// recomputed like any evicted storage.
int64_t Core::mark_handover(int op_id) {
  if (!cfg_.inplace_handover) return 0;
  const Op& op = ops_[op_id];
  int64_t bytes = 0;
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    const int j = op.inplace_of[i];
    if (j < 0) continue;
    const int so_id = tensors_[op.inputs[j]].storage;
    Storage& so = storages_[so_id];
    const Storage& sn = storages_[tensors_[op.outputs[i]].storage];
    if (sn.resident || sn.banished || so_id == tensors_[op.outputs[i]].storage) continue;
    if (!so.resident || so.refs != 0 || so.pinned || so.locks != 1 || so.wanted != 0 || so.handed) continue;
    so.handed = true;
    bytes += so.size;
  }
  return bytes;
}

void Core::finish(int op_id, bool remat) {
  (void)remat;
  for (int p : ops_[op_id].inputs) unlock(tensors_[p].storage);
  for (int p : ops_[op_id].inputs) {  // see Note [Handing bytes over on recomputation]
    const int sid = tensors_[p].storage;
    if (storages_[sid].handed && storages_[sid].resident) evict(sid, /*by_heuristic=*/false);
  }
  for (int p : ops_[op_id].inputs)  // an input waiting for its dependents to come back
    if (storages_[tensors_[p].storage].banish_pending) try_banish(tensors_[p].storage);
  if (c_.remat_compute > cfg_.remat_limit) throw Thrashing(c_.remat_compute, cfg_.remat_limit);
}

void Core::compute(int t, bool remat) {
  const int op_id = tensors_[t].op;
  const Op& op = ops_[op_id];
  if (on_compute) on_compute(op_id, remat);
  clock_ += op.cost;
  if (remat) {
    c_.remat_compute += op.cost;
    c_.remats += 1;
  } else {
    c_.base_compute += op.cost;
  }
  int64_t handed = 0;  // see Note [Handing bytes over on recomputation]
  if (remat)
    for (int p : op.inputs)
      if (storages_[tensors_[p].storage].handed) handed += storages_[tensors_[p].storage].size;
  c_.memory += op.total_size - handed;
  c_.peak_memory = std::max(c_.peak_memory, c_.memory);
  int64_t working = op.total_size;
  for (int p : op.inputs) working += ops_[tensors_[p].op].sizes[tensors_[p].index];
  c_.largest_op_bytes = std::max(c_.largest_op_bytes, working);

  // Outputs that were already defined are computed twice: the duplicate is freed.
  for (int u : op.outputs)
    if (tensors_[u].defined) c_.memory -= op.sizes[tensors_[u].index];
  std::vector<int> fresh;  // storages that become resident now
  for (int u : op.outputs) {
    Storage& s = storages_[tensors_[u].storage];
    if (s.banished) {  // a banished sibling is recomputed too, and freed at once
      c_.memory -= op.sizes[tensors_[u].index];
      continue;
    }
    if (!s.resident) {
      s.resident = true;
      fresh.push_back(tensors_[u].storage);
    }
    tensors_[u].defined = true;
  }
  for (int sid : fresh) {
    bt_touch_nbrs(sid);  // it counts in no neighbour's bound any more (Note [Choosing without scanning])
    after_remat(sid);
    pool_add(sid);
  }
}

void Core::after_remat(int sid) {
  Storage& s = storages_[sid];
  uf_leave(sid);
  if (cfg_.cost == CostMode::Full) dirty_frontier(sid);
  s.full_dirty = true;
}

// ---------------------------------------------------------------------------
// Eviction

void Core::make_room(int64_t bytes) {
  if (cfg_.budget < 0) return;
  while (c_.memory + bytes > cfg_.budget) {
    if (pool_.empty()) throw OutOfMemory(c_.memory + bytes, cfg_.budget);
    evict(choose(), /*by_heuristic=*/true);
  }
}

void Core::pool_add(int sid) {
  Storage& s = storages_[sid];
  if (s.pool_pos >= 0 || !s.resident || s.locks > 0 || s.pinned) return;
  s.pool_pos = int(pool_.size());
  s.pool_seq = next_seq_++;
  pool_.push_back(sid);
  bt_insert(sid);
}

void Core::pool_remove(int sid) {
  Storage& s = storages_[sid];
  if (s.pool_pos < 0) return;
  int last = pool_.back();
  pool_[s.pool_pos] = last;
  storages_[last].pool_pos = s.pool_pos;
  pool_.pop_back();
  s.pool_pos = -1;
  bt_erase(sid);
}

double Core::raw_score(int sid) {
  c_.heuristic_evals += 1;
  return eval_score(sid);
}

double Core::score(int sid) { return raw_score(sid); }

double Core::neighbourhood_cost(int sid) {
  switch (cfg_.cost) {
    case CostMode::EqClass: return eqclass_cost(sid);
    case CostMode::Full: return full_cost(sid);
    default: return 0.0;
  }
}

// Note [Choosing the victim]
// simrd scans its pool list in insertion order, keeps the last of equal
// scores, and stops at the first zero score. We keep the pool in a swap-remove
// array (O(1) add/remove) and reproduce the same choice from each entry's
// insertion sequence number: the earliest zero, else the minimum score with
// ties going to the latest entry. Scoring is a tight loop over cached per-storage
// terms; `sample` bounds it on very large pools.
int Core::choose() {
  const int n = int(pool_.size());
  if (cfg_.random) {
    std::uniform_int_distribution<int> dist(0, n - 1);
    return pool_[dist(rng_)];
  }
  bt_sync();
  if (bt_on_) return choose_bounded();
  int best = -1, zero = -1;
  double best_score = kInf;
  uint64_t best_seq = 0, zero_seq = 0;
  auto consider = [&](int sid) {
    double sc = raw_score(sid);
    uint64_t seq = storages_[sid].pool_seq;
    if (sc == 0) {
      if (zero < 0 || seq < zero_seq) { zero = sid; zero_seq = seq; }
    } else if (best < 0 || sc < best_score || (sc == best_score && seq > best_seq)) {
      best = sid; best_score = sc; best_seq = seq;
    }
  };
  if (cfg_.sample > 0 && n > cfg_.sample) {
    std::uniform_int_distribution<int> dist(0, n - 1);
    for (int k = 0; k < cfg_.sample; ++k) consider(pool_[dist(rng_)]);
  } else {
    for (int k = 0; k < n; ++k) consider(pool_[k]);
  }
  return zero >= 0 ? zero : best;
}

// Note [Choosing without scanning]
// choose() must return exactly the storage a scan of the whole pool would (the
// earliest zero score, else the least score, ties to the latest entry), but a
// scan costs O(pool) per eviction, so a replay whose pool grows with the log
// (a long chain keeping half its outputs) is quadratic, whatever the cost
// term: the scan, not the union-find, was the superlinear part. Scores cannot
// be kept sorted: stale(S) grows with the clock and c(S) with evictions far
// away, so their order changes all the time. Instead the pool members are the
// leaves of a min-tree (slots in order of last access; an access moves a
// member to a fresh slot at the end, a rebuild compacts the slots) whose nodes
// hold lower bounds over their leaves: of c(S)/m(S), and the least last access
// a. Then bound/(clock - a) is at most the score of every leaf below the node,
// and a branch-and-bound search (smaller bound first) skips a node whose bound
// is above the best score found so far (above 0 once a zero is found: an equal
// bound may hide a tie that wins on its sequence number). The choice is the
// scan's; only the storages it cannot rule out are scored.
//
// The bounds of c(S)/m(S): for local and none, exact; for eqclass, the larger
// of two. (1) cost(S) + the costs of its distinct evicted neighbours with a
// node (each of their components' value holds its members' costs), from S and
// its neighbours alone: whatever changes a neighbour (it comes back, leaves
// its component or is evicted, a cost changes) queues S's leaf
// (bt_touch_nbrs), and queued leaves are recomputed before the next choice.
// (2) The exact c(S) when last computed (the potential, bt_p): component
// values only grow by merging, so it stays a lower bound until a component
// next to S loses value (a member is recomputed, collected or banished, a
// cost falls, a split). For that, each component root lists the pool members
// whose potential counts its value (bt_register; the lists follow merges,
// smaller into larger, and may hold stale entries); a root whose value falls
// queues every member of its list (bt_walk), which registers again when
// recomputed. A scored leaf gets its exact c as potential, so a storage next
// to a big component is not scored again and again. A bound may be stale,
// never too high (Core::check() verifies both).
//
// The bounds must hold for the floating-point scores, not only the real ones:
// divisions are rounded down and the node bound is shrunk by a margin far
// above the few roundings of a score. The eqclass sums must be exact, which
// they are while every cost is a multiple of 2^-cost_bits_ and no sum can
// reach 2^52 at that grid (note_cost: integer and 1/8 costs, the usual ones,
// qualify), and while every component's value holds its members' costs:
// simrd's components (no eqclass_split) miss the cost of an alias output added
// to an evicted storage (new_op), and after that (uf_deficient_), off the
// grid, with random choice or sampling, and for dtr (whose e* walks cost more
// than the scan; its bound would be cost(S) alone), choose() scans as before.
// heuristic_evals still counts the whole pool, the paper's count of the
// policy's evaluations (and the reference core's); storage_accesses counts
// what is really touched (tree nodes, scored storages, neighbours, lists).

bool Core::bounds_exact() const {
  if (cfg_.random || cfg_.sample > 0 || cfg_.cost == CostMode::Full) return false;
  if (cfg_.cost != CostMode::EqClass) return true;
  return !uf_deficient_ && cost_bits_ < 1000 && std::ldexp(cost_total_, cost_bits_) < 4503599627370496.0;  // 2^52
}

void Core::bt_register(int sid) {
  const Storage& s = storages_[sid];
  if (s.uf_nbrs == 0) return;
  int roots[8];
  int nroots = 0;
  for (int dir = 0; dir < 2; ++dir)
    for (int n : dir == 0 ? s.deps : s.dependents) {
      const Storage& ns = storages_[n];
      if (ns.resident || ns.uf < 0) continue;
      const int r = uf_find(ns.uf);
      bool seen = false;
      for (int k = 0; k < nroots && !seen; ++k) seen = roots[k] == r;
      if (seen) continue;
      if (nroots < 8) roots[nroots++] = r;
      if (int(uf_front_.size()) <= r) uf_front_.resize(uf_.size());
      uf_front_[r].push_back(sid);  // (a duplicate beyond 8 roots is harmless)
    }
}

void Core::bt_walk(int root) {
  if (!bt_on_ || cfg_.cost != CostMode::EqClass || root >= int(uf_front_.size())) return;
  std::vector<int> list;
  list.swap(uf_front_[root]);
  for (int sid : list) {
    c_.storage_accesses += 1;
    bt_touch(sid);  // its bound is recomputed, and it registers again, before the next choice
  }
}

void Core::bt_note(int sid, double c) {
  Storage& s = storages_[sid];
  const double m = cfg_.use_size ? double(s.size) : 1.0;
  if (!(m > 0)) {  // every score is infinite (and a NaN here would poison the tree's minima)
    s.bt_p = kInf;
    return;
  }
  const double p = c / m;  // c is exact (see bounds_exact())
  s.bt_p = p > 0 ? std::nextafter(p, 0.0) : p;
}

void Core::note_cost(double cost, size_t storages) {
  int b = 0;
  while (b < 1100 && std::ldexp(cost, b) != std::floor(std::ldexp(cost, b))) ++b;
  cost_bits_ = std::max(cost_bits_, b);
  cost_total_ += cost * double(storages + 1);
}

double Core::eval_score(int sid) {
  Storage& s = storages_[sid];
  c_.storage_accesses += 1;
  double c = 1.0;
  switch (cfg_.cost) {
    case CostMode::None: break;
    case CostMode::Local: c = s.cost; break;
    case CostMode::EqClass: s.bt_c = eqclass_cost(sid); c = s.cost + s.bt_c; break;
    case CostMode::Full: c = s.cost + full_cost(sid); break;
  }
  double d = 1.0;
  if (cfg_.use_size) d *= double(s.size);
  if (cfg_.use_staleness) d *= clock_ - s.last_access;
  if (!(d > 0)) return kInf;
  return c / d;
}

double Core::bt_key(int sid) {
  const Storage& s = storages_[sid];
  double c = 1.0;
  if (cfg_.cost == CostMode::Local || cfg_.cost == CostMode::Full) c = s.cost;
  if (cfg_.cost == CostMode::EqClass) {
    c = s.cost;
    if (s.uf_nbrs > 0) {
      const uint64_t mark = ++stamp_;
      for (int dir = 0; dir < 2; ++dir)
        for (int n : dir == 0 ? s.deps : s.dependents) {
          Storage& ns = storages_[n];
          c_.storage_accesses += 1;
          if (ns.resident || ns.uf < 0 || ns.mark == mark) continue;
          ns.mark = mark;
          c += ns.cost;
        }
    }
  }
  const double m = cfg_.use_size ? double(s.size) : 1.0;
  if (!(m > 0)) return kInf;  // every score is infinite
  const double k = c / m;
  return k > 0 ? std::nextafter(k, 0.0) : k;
}

void Core::bt_set(int slot, int sid) {
  int i = bt_cap_ + slot;
  bt_sid_[slot] = sid;
  bt_k_[i] = sid < 0 ? kInf : storages_[sid].bt_k;
  bt_p_[i] = sid < 0 ? kInf : storages_[sid].bt_p;
  bt_m_[i] = sid < 0 ? kInf : cfg_.use_size ? double(storages_[sid].size) : 1.0;
  bt_a_[i] = sid < 0 ? kInf : storages_[sid].last_access;
  for (i >>= 1; i >= 1; i >>= 1) {
    bt_k_[i] = std::min(bt_k_[2 * i], bt_k_[2 * i + 1]);
    bt_p_[i] = std::min(bt_p_[2 * i], bt_p_[2 * i + 1]);
    bt_m_[i] = std::min(bt_m_[2 * i], bt_m_[2 * i + 1]);
    bt_a_[i] = std::min(bt_a_[2 * i], bt_a_[2 * i + 1]);
  }
}

void Core::bt_rebuild() {
  std::vector<int> live;
  for (int k = 0; k < bt_used_; ++k)
    if (bt_sid_[k] >= 0) live.push_back(bt_sid_[k]);
  int cap = 16;
  while (cap < 2 * int(live.size()) + 2) cap *= 2;
  bt_cap_ = cap;
  bt_used_ = int(live.size());
  bt_sid_.assign(cap, -1);
  bt_k_.assign(2 * cap, kInf);
  bt_p_.assign(2 * cap, kInf);
  bt_m_.assign(2 * cap, kInf);
  bt_a_.assign(2 * cap, kInf);
  for (int k = 0; k < bt_used_; ++k) {
    const int sid = live[k];
    storages_[sid].bt_slot = k;
    bt_sid_[k] = sid;
    bt_k_[cap + k] = storages_[sid].bt_k;
    bt_p_[cap + k] = storages_[sid].bt_p;
    bt_m_[cap + k] = cfg_.use_size ? double(storages_[sid].size) : 1.0;
    bt_a_[cap + k] = storages_[sid].last_access;
  }
  for (int i = cap - 1; i >= 1; --i) {
    bt_k_[i] = std::min(bt_k_[2 * i], bt_k_[2 * i + 1]);
    bt_p_[i] = std::min(bt_p_[2 * i], bt_p_[2 * i + 1]);
    bt_m_[i] = std::min(bt_m_[2 * i], bt_m_[2 * i + 1]);
    bt_a_[i] = std::min(bt_a_[2 * i], bt_a_[2 * i + 1]);
  }
}

void Core::bt_insert(int sid) {
  if (!bt_on_) return;
  if (bt_used_ >= bt_cap_) bt_rebuild();
  Storage& s = storages_[sid];
  s.bt_slot = bt_used_++;
  s.bt_k = 0;  // valid bounds until bt_flush() computes them
  s.bt_p = -kInf;
  bt_set(s.bt_slot, sid);
  s.bt_dirty = false;
  bt_touch(sid);
}

void Core::bt_erase(int sid) {
  Storage& s = storages_[sid];
  if (s.bt_slot < 0) return;
  bt_set(s.bt_slot, -1);
  s.bt_slot = -1;
}

void Core::bt_touch(int sid) {
  if (!bt_on_) return;
  Storage& s = storages_[sid];
  if (s.bt_slot < 0 || s.bt_dirty) return;
  s.bt_dirty = true;
  bt_dirty_.push_back(sid);
}

void Core::bt_touch_nbrs(int sid) {
  if (!bt_on_) return;
  bt_touch(sid);
  if (cfg_.cost != CostMode::EqClass) return;  // other bounds do not read the neighbours
  for (int dir = 0; dir < 2; ++dir)
    for (int n : dir == 0 ? storages_[sid].deps : storages_[sid].dependents) {
      c_.storage_accesses += 1;
      bt_touch(n);
    }
}

void Core::bt_flush() {
  for (size_t q = 0; q < bt_dirty_.size(); ++q) {
    const int sid = bt_dirty_[q];
    Storage& s = storages_[sid];
    s.bt_dirty = false;
    if (s.bt_slot < 0) continue;
    s.bt_k = bt_key(sid);
    if (cfg_.cost == CostMode::EqClass) {
      bt_note(sid, s.cost + eqclass_cost(sid));
      bt_register(sid);
    }
    if (bt_a_[bt_cap_ + s.bt_slot] != s.last_access) {  // accessed: a fresh slot keeps the slots in access order
      bt_set(s.bt_slot, -1);
      if (bt_used_ >= bt_cap_) {
        s.bt_slot = -1;
        bt_rebuild();
      }
      s.bt_slot = bt_used_++;
    }
    bt_set(s.bt_slot, sid);
  }
  bt_dirty_.clear();
}

void Core::bt_sync() {
  const bool want = bounds_exact();
  if (want == bt_on_) return;
  for (Storage& s : storages_) {
    s.bt_slot = -1;
    s.bt_dirty = false;
  }
  bt_dirty_.clear();
  bt_sid_.clear();
  bt_k_.clear();
  bt_p_.clear();
  bt_m_.clear();
  bt_a_.clear();
  bt_cap_ = bt_used_ = 0;
  uf_front_.clear();
  bt_on_ = want;
  if (!want) return;
  std::vector<int> order(pool_);
  std::sort(order.begin(), order.end(), [&](int x, int y) {
    const Storage &a = storages_[x], &b = storages_[y];
    return a.last_access != b.last_access ? a.last_access < b.last_access : a.pool_seq < b.pool_seq;
  });
  for (int sid : order) {
    storages_[sid].bt_k = bt_key(sid);
    storages_[sid].bt_p = -kInf;
    if (cfg_.cost == CostMode::EqClass) {
      bt_note(sid, storages_[sid].cost + eqclass_cost(sid));
      bt_register(sid);
    }
    bt_sid_.push_back(sid);
    bt_used_ += 1;
  }
  bt_rebuild();
}

int Core::choose_bounded() {
  bt_flush();
  c_.heuristic_evals += int64_t(pool_.size());
  int best = -1, zero = -1;
  double best_score = kInf;
  uint64_t best_seq = 0, zero_seq = 0;
  const double clock = clock_;
  const bool stale = cfg_.use_staleness;
  const bool pot = cfg_.cost == CostMode::EqClass;
  auto bound = [&](int i) {
    double b = pot ? std::max(bt_k_[i], bt_p_[i]) : bt_k_[i];  // both bound c/m of every leaf below
    if (stale) {
      const double dt = clock - bt_a_[i];
      b = dt > 0 ? b / dt : kInf;
    }
    return b * (1 - 1e-12);
  };
  auto visit = [&](auto& self, int i, double b) -> void {
    c_.storage_accesses += 1;
    if (bt_a_[i] == kInf) return;  // no leaf below
    if ((zero >= 0 && b > 0) || (best >= 0 && b > best_score)) return;
    if (i >= bt_cap_) {
      const int sid = bt_sid_[i - bt_cap_];
      const double sc = eval_score(sid);
      if (pot) {  // a tighter bound for the next choices
        Storage& s = storages_[sid];
        const double before = s.bt_p;
        bt_note(sid, s.cost + s.bt_c);
        if (s.bt_p != before) bt_set(i - bt_cap_, sid);
      }
      const uint64_t seq = storages_[sid].pool_seq;
      if (sc == 0) {
        if (zero < 0 || seq < zero_seq) { zero = sid; zero_seq = seq; }
      } else if (best < 0 || sc < best_score || (sc == best_score && seq > best_seq)) {
        best = sid; best_score = sc; best_seq = seq;
      }
      return;
    }
    const double bl = bound(2 * i), br = bound(2 * i + 1);
    if (br < bl) {
      self(self, 2 * i + 1, br);
      self(self, 2 * i, bl);
    } else {
      self(self, 2 * i, bl);
      self(self, 2 * i + 1, br);
    }
  };
  visit(visit, 1, bound(1));
  return zero >= 0 ? zero : best;
}

void Core::evict(int sid, bool by_heuristic) {
  Storage& s = storages_[sid];
  if (!s.resident || s.locks > 0 || s.pinned) throw std::logic_error("evicting an unevictable storage");
  s.resident = false;
  if (!s.handed) c_.memory -= s.size;  // a handed storage's bytes are its successor's now
  pool_remove(sid);
  for (int t : s.tensors) tensors_[t].defined = false;
  if (by_heuristic) c_.evictions += 1; else c_.eager_evictions += 1;
  if (cfg_.cost == CostMode::EqClass) {
    s.uf = int(uf_.size());
    uf_.push_back(UFNode{s.uf, s.cost});
    auto merge_with = [&](const std::vector<int>& nbrs) {
      for (int n : nbrs) {
        const Storage& ns = storages_[n];
        c_.storage_accesses += 1;
        if (!ns.resident && !ns.banished && ns.uf >= 0) uf_merge(ns.uf, storages_[sid].uf);
      }
    };
    merge_with(storages_[sid].deps);
    merge_with(storages_[sid].dependents);
    count_uf_nbrs(sid, +1);
    bt_touch_nbrs(sid);  // their bounds grow
  }
  if (cfg_.cost == CostMode::Full) dirty_frontier(sid);
  if (on_evict) on_evict(sid, by_heuristic);  // (a replay's trace skips a handed storage: reported already)
  storages_[sid].handed = false;
}

void Core::try_banish(int sid) {
  Storage& s = storages_[sid];
  if (s.banished || s.refs > 0) return;
  // Banishing needs every tensor that depends on S to be defined: an evicted
  // dependent storage, or an undefined view on a resident one (views come back
  // by rerunning their op, which reads S), would need S again.
  for (int d : s.dependents) {
    const Storage& ds = storages_[d];
    if (ds.banished) continue;
    bool needs = !ds.resident;
    for (size_t k = 0; k < ds.tensors.size() && !needs; ++k) {
      const Tensor& x = tensors_[ds.tensors[k]];
      if (x.defined) continue;
      for (int u : ops_[x.op].inputs) needs = needs || tensors_[u].storage == sid;
    }
    if (needs) {
      s.banish_pending = true;
      return;
    }
  }
  banish(sid);
}

void Core::banish(int sid) {
  Storage& s = storages_[sid];
  s.banish_pending = false;
  if (s.locks > (s.pinned ? 1 : 0)) {  // in use right now: retry when a dependent comes back
    s.banish_pending = true;
    return;
  }
  if (s.pinned) {
    s.pinned = false;
    s.locks -= 1;
  }
  if (s.resident) {
    s.resident = false;
    c_.memory -= s.size;
    pool_remove(sid);
    for (int t : s.tensors) tensors_[t].defined = false;
    if (on_evict) on_evict(sid, false);
  }
  s.banished = true;
  c_.banishments += 1;
  // Nothing recomputes a banished storage: exact components drop it (simrd's
  // keep its cost, and only stop merging through it).
  if (cfg_.eqclass_split && s.uf >= 0) uf_leave(sid);
  // Its dependents can never be recomputed again: they become constants.
  for (int d : s.dependents) {
    Storage& ds = storages_[d];
    if (ds.banished || ds.pinned) continue;
    if (ds.resident) {
      lock(d);
      ds.pinned = true;
      if (on_pin) on_pin(d);
    }
  }
}

// ---------------------------------------------------------------------------
// Evicted neighbourhoods

int Core::uf_find(int n) {
  int r = n;
  while (uf_[r].parent != r) {
    r = uf_[r].parent;
    c_.storage_accesses += 1;
  }
  while (uf_[n].parent != r) {
    int next = uf_[n].parent;
    uf_[n].parent = r;
    n = next;
  }
  return r;
}

void Core::uf_merge(int a, int b) {
  int ra = uf_find(a), rb = uf_find(b);
  if (ra == rb) return;
  uf_[ra].parent = rb;
  uf_[rb].value += uf_[ra].value;
  if (ra < int(uf_front_.size()) && !uf_front_[ra].empty()) {  // the bound tree's registrations follow (smaller into larger)
    if (int(uf_front_.size()) <= rb) uf_front_.resize(uf_.size());
    std::vector<int>& from = uf_front_[ra];
    std::vector<int>& to = uf_front_[rb];
    if (from.size() > to.size()) from.swap(to);
    to.insert(to.end(), from.begin(), from.end());
    std::vector<int>().swap(from);
  }
}

void Core::count_uf_nbrs(int sid, int delta) {
  for (int n : storages_[sid].deps) storages_[n].uf_nbrs += delta;
  for (int n : storages_[sid].dependents) storages_[n].uf_nbrs += delta;
}

// Note [Splitting eqclass components]
// eqclass approximates e*(S), the cost of the evicted storages joined to S
// through evicted storages, by union-find components: a storage evicted next
// to evicted neighbours joins their components (evict()), and e*(S) is the sum
// of the values of the components next to S. Union-find cannot split: when a
// member leaves (it is rematerialized, collected or banished), simrd only
// subtracts its cost from the component's value, so the evicted storages on
// both sides of a storage that is resident again keep counting each other's
// cost. In a long evicted region (an unrolled recurrence, a finished backward)
// this over-approximation grows with every recomputation in it.
//
// With Config::eqclass_split the components are exact: they are the connected
// components of the graph of evicted storages (the storages with a node; its
// edges are deps/dependents), and each root's value is the sum of its
// members' costs. Every member owns its node. A member x leaves through
// uf_leave():
//  * if at most one neighbour edge of x leads to a member (uf_nbrs <= 1), x is
//    a leaf of its component, removing it disconnects nothing, and subtracting
//    its cost is exact: O(1). This is the common case: a chain recomputed from
//    its resident end.
//  * otherwise one search starts from each distinct member neighbour of x, and
//    the searches run in lockstep, one storage at a time each. Searches that
//    meet merge into a group; a group with nothing left to scan is a whole
//    piece. Once at most one group is still searching, every finished group
//    is a component of its own: its members get fresh nodes under a fresh
//    root holding its sum (their old nodes may still be on the paths of the
//    storages that stay, so they are left as they are). The group still
//    searching is the rest of the old component and keeps the old root, whose
//    value loses x's cost and the pieces split off. Each storage is scanned at
//    most once, so a leave costs at most the component and its edges, and
//    usually much less: about the number of searches times what the pieces
//    split off (or the searches before they meet) hold.
// collect() removes its garbage in one batch (uf_leave_all()): uf_rebuild()
// walks each affected component once from the members next to the leavers and
// gives each piece a root with its exact sum, rewiring every member's own node
// to it (all the members of an affected component are rewired, so no path
// through an old node is read again). Components only ever join through
// evict() and through the edges a new alias output adds between two evicted
// storages (new_op()), so they stay exact; compact() keeps them; new_op() and
// change_cost() keep the values exact sums when a member's cost changes; a
// banished member leaves. The scores are then those of e* over undirected
// evicted paths (dtr's `full` follows directed ones). Without the flag the
// core keeps simrd's behaviour, which the published experiments use.

void Core::uf_leave(int sid) {
  Storage& s = storages_[sid];
  if (s.uf < 0) return;
  bt_touch_nbrs(sid);
  const int root = uf_find(s.uf);
  const double cost = s.cost;
  const int nbr_edges = s.uf_nbrs;
  s.uf = -1;
  count_uf_nbrs(sid, -1);
  if (!cfg_.eqclass_split || nbr_edges <= 1) {
    uf_[root].value -= cost;  // simrd's splitting over-approximation (exact for a leaf)
    bt_walk(root);
    return;
  }
  // One search per distinct member neighbour (a seed), run in lockstep, one
  // storage at a time each; the label of a storage is base + its search.
  const uint64_t base = stamp_ + 1;
  stamp_ += uint64_t(nbr_edges);
  std::vector<int> seeds;
  for (int dir = 0; dir < 2; ++dir)
    for (int n : dir == 0 ? storages_[sid].deps : storages_[sid].dependents) {
      Storage& ns = storages_[n];
      if (ns.uf < 0 || (ns.mark >= base && ns.mark < base + seeds.size())) continue;
      ns.mark = base + seeds.size();
      seeds.push_back(n);
    }
  const int k = int(seeds.size());
  if (k <= 1) {
    uf_[root].value -= cost;
    bt_walk(root);
    return;
  }
  std::vector<std::vector<int>> stack(k), members(k);
  std::vector<int> group(k);        // union-find over the searches: those that met
  std::vector<int64_t> pending(k);  // per group (at its root): storages found, not yet scanned
  std::vector<double> sum(k);       // per group: the costs of the storages found
  for (int i = 0; i < k; ++i) {
    stack[i].assign(1, seeds[i]);
    members[i].assign(1, seeds[i]);
    group[i] = i;
    pending[i] = 1;
    sum[i] = storages_[seeds[i]].cost;
  }
  auto gfind = [&](int i) {
    while (group[i] != i) i = group[i] = group[group[i]];
    return i;
  };
  int alive = k;  // groups with storages left to scan
  while (alive > 1) {
    for (int i = 0; i < k && alive > 1; ++i) {
      if (stack[i].empty()) continue;
      const int x = stack[i].back();
      stack[i].pop_back();
      int g = gfind(i);
      pending[g] -= 1;
      for (int dir = 0; dir < 2; ++dir)
        for (int n : dir == 0 ? storages_[x].deps : storages_[x].dependents) {
          Storage& ns = storages_[n];
          c_.storage_accesses += 1;
          if (ns.uf < 0) continue;
          if (ns.mark >= base && ns.mark < base + uint64_t(k)) {
            const int h = gfind(int(ns.mark - base));
            if (h == g) continue;
            if (pending[h] > 0) alive -= 1;  // two searches met: one group
            group[h] = g;
            pending[g] += pending[h];
            sum[g] += sum[h];
            continue;
          }
          ns.mark = base + uint64_t(i);
          stack[i].push_back(n);
          members[i].push_back(n);
          pending[g] += 1;
          sum[g] += ns.cost;
        }
      if (pending[g] == 0) alive -= 1;  // a whole piece: nothing more joins it
    }
  }
  // The one group still searching (or, if none is, the last piece) keeps the
  // old root, whose value loses the leaver and the pieces split off; every
  // other group is a finished piece and gets fresh nodes (the old nodes of its
  // members may still be on the paths of the storages that keep the root).
  int keep = -1;
  for (int i = 0; i < k; ++i)
    if (gfind(i) == i && (keep < 0 || pending[i] > 0)) keep = i;
  double split_off = 0;
  std::vector<int> fresh_root(k, -1);
  for (int i = 0; i < k; ++i) {
    const int g = gfind(i);
    if (g == keep) continue;
    if (fresh_root[g] < 0) {
      fresh_root[g] = int(uf_.size());
      uf_.push_back(UFNode{fresh_root[g], sum[g]});
      split_off += sum[g];
    }
    for (int m : members[i]) {
      const int node = int(uf_.size());
      uf_.push_back(UFNode{fresh_root[g], 0.0});
      storages_[m].uf = node;
    }
  }
  if (keep >= 0 && pending[keep] == 0) uf_[root].value = sum[keep];  // all pieces finished: exact sum
  else uf_[root].value -= cost + split_off;
  bt_walk(root);  // the pieces split off have fresh roots: their neighbours register there again
}

void Core::uf_leave_all(const std::vector<int>& sids) {
  if (!cfg_.eqclass_split) {
    for (int sid : sids) uf_leave(sid);
    return;
  }
  std::vector<int> seeds;
  for (int sid : sids) {
    Storage& s = storages_[sid];
    if (s.uf < 0) continue;
    bt_touch_nbrs(sid);
    s.uf = -1;
    count_uf_nbrs(sid, -1);
  }
  for (int sid : pool_) bt_touch(sid);  // components are rebuilt: any value may fall, so refresh every bound
  for (int sid : sids) {  // the members next to a leaver reach every member left in its component
    for (int n : storages_[sid].deps)
      if (storages_[n].uf >= 0) seeds.push_back(n);
    for (int n : storages_[sid].dependents)
      if (storages_[n].uf >= 0) seeds.push_back(n);
  }
  uf_rebuild(seeds);
}

void Core::uf_rebuild(const std::vector<int>& seeds) {
  const uint64_t mark = ++stamp_;
  std::vector<int> piece, stack;
  for (int seed : seeds) {
    if (storages_[seed].mark == mark) continue;  // in a piece already rebuilt
    piece.clear();
    storages_[seed].mark = mark;
    stack.assign(1, seed);
    double sum = 0;
    while (!stack.empty()) {
      const int x = stack.back();
      stack.pop_back();
      piece.push_back(x);
      sum += storages_[x].cost;
      for (int dir = 0; dir < 2; ++dir)
        for (int n : dir == 0 ? storages_[x].deps : storages_[x].dependents) {
          Storage& ns = storages_[n];
          c_.storage_accesses += 1;
          if (ns.uf < 0 || ns.mark == mark) continue;
          ns.mark = mark;
          stack.push_back(n);
        }
    }
    const int root = storages_[seed].uf;
    for (int m : piece) uf_[storages_[m].uf] = UFNode{root, 0.0};
    uf_[root].value = sum;
  }
}

double Core::eqclass_cost(int sid) {
  const Storage& s = storages_[sid];
  if (s.uf_nbrs == 0) return 0.0;  // no evicted neighbour: the common case
  int roots[16];
  int nroots = 0;
  std::vector<int> more;
  double sum = 0;
  auto visit = [&](const std::vector<int>& nbrs) {
    for (int n : nbrs) {
      const Storage& ns = storages_[n];
      if (ns.resident || ns.uf < 0) continue;
      c_.storage_accesses += 1;
      int r = uf_find(ns.uf);
      bool seen = false;
      for (int k = 0; k < nroots && !seen; ++k) seen = roots[k] == r;
      if (!seen) seen = contains(more, r);
      if (seen) continue;
      if (nroots < 16) roots[nroots++] = r; else more.push_back(r);
      sum += uf_[r].value;
    }
  };
  visit(s.deps);
  visit(s.dependents);
  return sum;
}

double Core::full_cost(int sid) {
  Storage& s = storages_[sid];
  if (!s.full_dirty) return s.full_cost;
  // e*(S): evicted storages reachable from S through evicted storages, along
  // dependency edges (ancestors) and along dependent edges (descendants).
  double sum = 0;
  const uint64_t up = ++stamp_;
  std::vector<int> stack;
  auto walk = [&](uint64_t mark, bool ancestors, bool add) {
    stack.clear();
    storages_[sid].mark = mark;
    stack.push_back(sid);
    while (!stack.empty()) {
      int x = stack.back();
      stack.pop_back();
      const std::vector<int>& nbrs = ancestors ? storages_[x].deps : storages_[x].dependents;
      for (int n : nbrs) {
        Storage& ns = storages_[n];
        if (ns.resident || ns.banished || ns.mark == mark) continue;
        c_.storage_accesses += 1;
        if (add || ns.mark != up) sum += ns.cost;
        ns.mark = mark;
        stack.push_back(n);
      }
    }
  };
  walk(up, /*ancestors=*/true, /*add=*/true);
  // Descendants: a storage already counted as an ancestor (only possible when
  // views make the storage graph cyclic) is counted once.
  const uint64_t down = ++stamp_;
  walk(down, /*ancestors=*/false, /*add=*/false);
  s.full_cost = sum;
  s.full_dirty = false;
  return sum;
}

void Core::dirty_frontier(int sid) {
  // Every resident storage whose e* can change when `sid` flips between
  // resident and evicted is joined to it by a directed path of evicted storages.
  storages_[sid].full_dirty = true;
  std::vector<int> stack;
  for (int dir = 0; dir < 2; ++dir) {
    const uint64_t mark = ++stamp_;
    stack.assign(1, sid);
    while (!stack.empty()) {
      int x = stack.back();
      stack.pop_back();
      const std::vector<int>& nbrs = dir == 0 ? storages_[x].deps : storages_[x].dependents;
      for (int n : nbrs) {
        Storage& ns = storages_[n];
        if (ns.mark == mark) continue;
        ns.mark = mark;
        c_.storage_accesses += 1;
        if (ns.resident) ns.full_dirty = true;
        else if (!ns.banished) stack.push_back(n);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Invariants

void Core::check() const {
  auto fail = [](const std::string& m) { throw std::logic_error("core invariant violated: " + m); };
  // Ids first (compaction renumbers them): every reference is in range and mirrored.
  const int nt = int(tensors_.size()), no = int(ops_.size()), ns = int(storages_.size());
  auto in = [](int id, int n) { return id >= 0 && id < n; };
  for (int t = 0; t < nt; ++t) {
    const Tensor& x = tensors_[t];
    const std::string name = "tensor " + std::to_string(t);
    if (!in(x.storage, ns) || !in(x.op, no)) fail(name + ": storage or op out of range");
    const Op& op = ops_[x.op];
    if (!in(x.index, int(op.outputs.size())) || op.outputs[x.index] != t) fail(name + ": not its op's output");
    if (!contains(storages_[x.storage].tensors, t)) fail(name + ": missing from its storage's tensors");
  }
  std::vector<char> read_live(nt, 0);  // tensors that an op not collected reads
  for (int o = 0; o < no; ++o) {
    const Op& op = ops_[o];
    const std::string name = "op " + std::to_string(o);
    for (int t : op.outputs)
      if (!in(t, nt) || tensors_[t].op != o) fail(name + ": output out of range or not its own");
    for (int u : op.inputs) {
      if (u == -1 && op.collected) continue;  // dropped by compact()
      if (!in(u, nt)) fail(name + ": input out of range");
      if (!op.collected && storages_[tensors_[u].storage].collected) fail(name + ": live op reads a collected storage");
      if (!op.collected) read_live[u] = 1;
    }
  }
  for (int o = 0; o < no; ++o) {
    const Op& op = ops_[o];
    if (!op.collected) continue;
    // A collected op is never computed again (Note [Collection and compaction]):
    // each output is gone for good, defined on a constant, or an undefined
    // tensor of a dead constant that nothing asks for (unreferenced, read by
    // no op that is not collected: a tensor is only recomputed when required
    // or as an undefined input of an op being recomputed).
    for (int t : op.outputs) {
      const Tensor& x = tensors_[t];
      const Storage& s = storages_[x.storage];
      if (s.collected || s.banished || (s.pinned && (x.defined || (x.refs == 0 && !read_live[t])))) continue;
      fail("op " + std::to_string(o) + ": collected, but its output " + std::to_string(t) + " may be recomputed");
    }
  }
  int collected = 0, pooled = 0;
  for (int sid = 0; sid < ns; ++sid) {
    const Storage& s = storages_[sid];
    const std::string name = "storage " + std::to_string(sid);
    if (!in(s.root, nt) || tensors_[s.root].storage != sid) fail(name + ": root out of range or elsewhere");
    for (int o : s.ops)
      if (!in(o, no)) fail(name + ": op out of range");
    for (int t : s.tensors)
      if (!in(t, nt)) fail(name + ": tensor out of range");
    for (int d : s.deps)
      if (!in(d, ns) || d == sid) fail(name + ": dependency out of range");
    for (int d : s.dependents)
      if (!in(d, ns) || d == sid || !contains(storages_[d].deps, sid)) fail(name + ": dependent edge not mirrored");
    if (s.uf >= int(uf_.size())) fail(name + ": eqclass node out of range");
    if (s.collected) {
      collected += 1;
      if (s.resident || !s.banished || s.uf >= 0) fail(name + ": collected but not freed, banished and node-less");
    }
    pooled += s.pool_pos >= 0;
  }
  if (collected != num_collected_) fail("count of collected storages is stale");
  if (pooled != int(pool_.size())) fail("pool holds storages that do not know it");
  int64_t mem = 0;
  for (size_t sid = 0; sid < storages_.size(); ++sid) {
    const Storage& s = storages_[sid];
    std::string name = "storage " + std::to_string(sid);
    if (s.resident) mem += s.size;
    bool evictable = s.resident && s.locks == 0 && !s.pinned;
    if (evictable != (s.pool_pos >= 0)) fail(name + ": pool membership disagrees with evictability");
    if (s.pool_pos >= 0 && (s.pool_pos >= int(pool_.size()) || pool_[s.pool_pos] != int(sid)))
      fail(name + ": pool position is stale");
    if (s.locks < 0) fail(name + ": negative lock count");
    if (s.wanted != 0) fail(name + ": wanted by a materialization between instructions");
    if (s.pinned && (!s.resident || s.locks < 1)) fail(name + ": pinned but not resident and locked");
    if (cfg_.cost == CostMode::EqClass && !s.resident && !s.banished && s.uf < 0)
      fail(name + ": evicted storage without an eqclass node");
    if (s.resident && s.uf >= 0) fail(name + ": resident storage still has an eqclass node");
    if (s.banished && s.resident) fail(name + ": banished but resident");
    int64_t refs = 0;
    for (int t : s.tensors) {
      const Tensor& x = tensors_[t];
      if (x.storage != int(sid)) fail(name + ": tensor list is inconsistent");
      if (x.defined && !s.resident) fail("tensor " + std::to_string(t) + " defined on an evicted storage");
      if (x.refs < 0) fail("tensor " + std::to_string(t) + " has negative refs");
      refs += x.refs;
    }
    if (refs != s.refs) fail(name + ": refs differ from the sum over its tensors");
    double cost = 0;
    for (int o : s.ops) cost += ops_[o].cost;
    if (std::abs(cost - s.cost) > 1e-9 * std::max(1.0, std::abs(cost))) fail(name + ": cached cost is stale");
    int uf_nbrs = 0;
    for (int d : s.deps) {
      if (!contains(storages_[d].dependents, int(sid))) fail(name + ": dependency edge not mirrored");
      uf_nbrs += storages_[d].uf >= 0;
    }
    for (int d : s.dependents) uf_nbrs += storages_[d].uf >= 0;
    if (uf_nbrs != s.uf_nbrs) fail(name + ": count of neighbours with an eqclass node is stale");
  }
  for (int sid = 0; sid < ns; ++sid)
    if (storages_[sid].handed) fail("storage " + std::to_string(sid) + " still handed over between calls");
  if (mem != c_.memory) fail("memory counter " + std::to_string(c_.memory) + " != resident bytes " + std::to_string(mem));
  if (c_.peak_memory < c_.memory) fail("peak below current memory");
  if (cfg_.budget >= 0 && c_.memory > cfg_.budget) fail("memory above budget");
  for (size_t r = 0; r < uf_.size(); ++r)
    if (uf_[r].parent < 0 || uf_[r].parent >= int(uf_.size())) fail("union-find parent out of range");
  {  // every evicted storage owns its node (splitting rewires a member's node)
    std::vector<char> owned(uf_.size(), 0);
    for (int sid = 0; sid < ns; ++sid) {
      const int n = storages_[sid].uf;
      if (n < 0) continue;
      if (owned[n]) fail("storage " + std::to_string(sid) + " shares its eqclass node with another storage");
      owned[n] = 1;
    }
  }
  if (cfg_.cost == CostMode::EqClass && cfg_.eqclass_split) {
    // Exact components (Note [Splitting eqclass components]): members are the
    // storages with a node; each root's value is the sum of its members'
    // costs; members joined by an edge share a root; and a root's members are
    // connected (one walk from any of them reaches them all). O(storages + edges).
    std::vector<int> root(storages_.size(), -1), count(uf_.size(), 0);
    std::vector<double> sum(uf_.size(), 0.0);
    double scale = 1.0;
    for (int sid = 0; sid < ns; ++sid) {
      const Storage& s = storages_[sid];
      scale += std::abs(s.cost);
      if (s.uf < 0) continue;
      if (s.banished) fail("storage " + std::to_string(sid) + ": banished but in an eqclass component");
      int r = s.uf, steps = 0;
      while (uf_[r].parent != r) {
        r = uf_[r].parent;
        if (++steps > int(uf_.size())) fail("union-find cycle");
      }
      root[sid] = r;
      count[r] += 1;
      sum[r] += s.cost;
    }
    std::vector<char> seen(storages_.size(), 0);
    std::vector<int> stack;
    for (int sid = 0; sid < ns; ++sid) {
      if (root[sid] < 0) continue;
      for (int d : storages_[sid].deps)
        if (root[d] >= 0 && root[d] != root[sid])
          fail("storages " + std::to_string(sid) + " and " + std::to_string(d) +
               " are evicted neighbours in different eqclass components");
      if (seen[sid]) continue;
      const int r = root[sid];
      int reached = 0;
      seen[sid] = 1;
      stack.assign(1, sid);
      while (!stack.empty()) {
        const int x = stack.back();
        stack.pop_back();
        reached += 1;
        for (int dir = 0; dir < 2; ++dir)
          for (int n : dir == 0 ? storages_[x].deps : storages_[x].dependents)
            if (root[n] >= 0 && !seen[n]) {
              seen[n] = 1;
              stack.push_back(n);
            }
      }
      if (reached != count[r])
        fail("eqclass component of storage " + std::to_string(sid) + " is not connected (" +
             std::to_string(reached) + " of its " + std::to_string(count[r]) + " members reachable)");
      // Values drift by rounding only (each member's cost was added and
      // subtracted once per change): bound it by the total cost of the graph.
      if (std::abs(uf_[r].value - sum[r]) > 1e-9 * scale)
        fail("eqclass component of storage " + std::to_string(sid) + ": value " + std::to_string(uf_[r].value) +
             " != sum of its members' costs " + std::to_string(sum[r]));
    }
  }
  // The bound tree (Note [Choosing without scanning]): every pool member has
  // its leaf, and a leaf not queued for a refresh holds no more than its bound.
  if (bt_on_) {
    int leaves = 0;
    for (int k = 0; k < bt_used_; ++k) leaves += bt_sid_[k] >= 0;
    if (leaves != int(pool_.size())) fail("bound tree has " + std::to_string(leaves) + " leaves, pool " +
                                          std::to_string(pool_.size()));
    for (int sid : pool_) {
      const Storage& s = storages_[sid];
      if (s.bt_slot < 0 || s.bt_slot >= bt_used_ || bt_sid_[s.bt_slot] != sid)
        fail("pool storage " + std::to_string(sid) + " has no leaf in the bound tree");
      if (s.bt_dirty) continue;
      double c = cfg_.cost == CostMode::None ? 1.0 : s.cost;
      if (cfg_.cost == CostMode::EqClass) {
        std::vector<int> seen;
        for (int dir = 0; dir < 2; ++dir)
          for (int n : dir == 0 ? s.deps : s.dependents) {
            const Storage& ns = storages_[n];
            if (ns.resident || ns.uf < 0 || contains(seen, n)) continue;
            seen.push_back(n);
            c += ns.cost;
          }
      }
      const double m = cfg_.use_size ? double(s.size) : 1.0;
      const double k = m > 0 ? c / m : kInf;
      if (bt_k_[bt_cap_ + s.bt_slot] > k || bt_a_[bt_cap_ + s.bt_slot] > s.last_access)
        fail("bound tree leaf of storage " + std::to_string(sid) + " is above its bound");
      if (cfg_.cost == CostMode::EqClass && m > 0) {  // its potential, less what values lost since
        double e = s.cost;
        std::vector<int> roots;
        for (int dir = 0; dir < 2; ++dir)
          for (int n : dir == 0 ? s.deps : s.dependents) {
            const Storage& ns = storages_[n];
            if (ns.resident || ns.uf < 0) continue;
            const int r = uf_root(ns.uf);
            if (contains(roots, r)) continue;
            roots.push_back(r);
            e += uf_[r].value;
          }
        if (s.bt_p * m > e)
          fail("bound tree potential of storage " + std::to_string(sid) + " is above its cost");
      }
    }
  }
}

}  // namespace dtr
