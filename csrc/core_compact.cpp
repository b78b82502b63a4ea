// core_compact.cpp - graph garbage collection: collect() and compact().
#include "core_internal.h"

namespace dtr {

// ---------------------------------------------------------------------------
// Collection and compaction

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
  const std::vector<char> needed = find_needed();
  std::pair<std::vector<int>, std::vector<int>> out;
  std::vector<int> leaving;  // evicted storages leaving their components (split all at once)
  for (size_t s = 0; s < storages_.size(); ++s) {
    const Storage& st = storages_[s];
    if (st.collected || needed[s]) continue;
    if (st.pinned) {
      // A dropped constant of no bytes stays pinned while anything may need it
      // (see release()); once nothing can, it is garbage like any other.
      if (st.size != 0 || st.refs > 0 || st.locks != 1) continue;
      storages_[s].pinned = false;
      storages_[s].locks = 0;
    }
    drop_garbage(int(s), cfg_.semantics.eqclass_split ? &leaving : nullptr);
    out.second.push_back(int(s));
  }
  uf_leave_all(leaving);
  for (size_t o = 0; o < ops_.size(); ++o) {
    Op& op = ops_[o];
    if (op.collected) continue;
    bool keep = false;
    for (int t : op.outputs) {
      const Tensor& x = tensors_[t];
      const Storage& s = storages_[x.storage];
      // (A banished output is never kept: an op runs again only for the others.)
      keep = keep || (needed[x.storage] && !s.banished && !(s.pinned && x.defined));
    }
    if (keep) continue;
    op.collected = true;
    out.first.push_back(int(o));
  }
  return out;
}

// Per storage: needed (see the Note), by a walk from the referenced and
// locked storages through the dependencies of those that may be recomputed.
std::vector<char> Core::find_needed() {
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
  // (A copy of the stamps: freeing garbage may walk the graph (dirty_frontier), which reuses them.)
  std::vector<char> needed(storages_.size());
  for (size_t s = 0; s < storages_.size(); ++s) needed[s] = storages_[s].mark == mark;
  return needed;
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

Core::Remap Core::compact() {
  std::vector<char> keep_o, keep_s;
  find_kept(keep_o, keep_s);
  Remap r = number_kept(keep_o, keep_s);
  renumber_ops_and_tensors(r);
  renumber_storages(r);
  for (int& s : pool_) s = r.storages[s];
  for (int& o : plan_op_) o = o >= 0 ? r.ops[o] : -1;  // (an ordinal whose op was dropped names nothing)
  if (bt_on_) bt_clear();  // ids changed: the next choice builds the tree again
  num_collected_ = 0;
  for (Storage& st : storages_) {
    num_collected_ += st.collected;
    st.uf_nbrs = 0;
    for (int d : st.deps) st.uf_nbrs += storages_[d].uf >= 0;
    for (int d : st.dependents) st.uf_nbrs += storages_[d].uf >= 0;
  }
  return r;
}

// The kept set: what is not collected, closed over "a kept storage keeps
// the ops with an output on it" and "a kept op keeps its outputs' storages".
void Core::find_kept(std::vector<char>& keep_o, std::vector<char>& keep_s) const {
  const int nops = int(ops_.size()), nss = int(storages_.size());
  keep_o.assign(nops, 0);
  keep_s.assign(nss, 0);
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
}

// The old -> new id maps: kept ops and storages, and the tensors of kept storages, in order.
Core::Remap Core::number_kept(const std::vector<char>& keep_o, const std::vector<char>& keep_s) const {
  const int nops = int(ops_.size()), nts = int(tensors_.size()), nss = int(storages_.size());
  Remap r;
  r.ops.assign(nops, -1);
  r.tensors.assign(nts, -1);
  r.storages.assign(nss, -1);
  int n = 0;
  for (int o = 0; o < nops; ++o)
    if (keep_o[o]) r.ops[o] = n++;
  n = 0;
  for (int s = 0; s < nss; ++s)
    if (keep_s[s]) r.storages[s] = n++;
  n = 0;
  for (int t = 0; t < nts; ++t)
    if (keep_s[tensors_[t].storage]) r.tensors[t] = n++;
  return r;
}

// The kept ops and tensors, renumbered (a kept op's dropped input reads -1).
void Core::renumber_ops_and_tensors(const Remap& r) {
  std::vector<Op> ops;
  for (int o = 0; o < int(ops_.size()); ++o) {
    if (r.ops[o] < 0) continue;
    Op op = std::move(ops_[o]);
    for (int& u : op.inputs) u = u >= 0 ? r.tensors[u] : -1;
    for (int& t : op.outputs) t = r.tensors[t];
    ops.push_back(std::move(op));
  }
  std::vector<Tensor> tensors;
  for (int t = 0; t < int(tensors_.size()); ++t) {
    if (r.tensors[t] < 0) continue;
    Tensor x = tensors_[t];
    x.storage = r.storages[x.storage];
    x.op = r.ops[x.op];
    tensors.push_back(x);
  }
  ops_ = std::move(ops);
  tensors_ = std::move(tensors);
}

// The kept storages, renumbered, without their edges to dropped ones; and the
// union-find rebuilt with one node per kept evicted storage (see the Note).
void Core::renumber_storages(const Remap& r) {
  std::vector<UFNode> uf;
  std::vector<int> new_root(uf_.size(), -1);
  std::vector<Storage> storages;
  auto remap_ids = [](std::vector<int>& ids, const std::vector<int>& m) {
    size_t k = 0;
    for (int id : ids)
      if (m[id] >= 0) ids[k++] = m[id];
    ids.resize(k);
  };
  for (int s = 0; s < int(storages_.size()); ++s) {
    if (r.storages[s] < 0) continue;
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
  storages_ = std::move(storages);
  uf_ = std::move(uf);
}

}  // namespace dtr
