// core_check.cpp - Core::check(), the invariants of core.h.
#include "core_internal.h"

#include <cmath>

namespace dtr {

namespace {

[[noreturn]] void fail(const std::string& m) { throw std::logic_error("core invariant violated: " + m); }

bool in(int id, int n) { return id >= 0 && id < n; }

}  // namespace

// ---------------------------------------------------------------------------
// Invariants
//
// check() runs its groups of checks in a fixed order and reports the first
// violation it meets. Ids come first (compaction renumbers them): every later
// check indexes the tables through them.

void Core::check() const {
  if (plan_depth_ != 0 || !planned_ops_.empty()) fail("a materialization's plan is left between instructions");
  for (size_t o = 0; o < ops_.size(); ++o)
    if (ops_[o].planned) fail("op " + std::to_string(o) + " is planned between instructions");
  check_tensor_ids();
  const std::vector<char> read_live = check_op_ids();
  check_collected_ops(read_live);
  check_storage_ids();
  check_storages();
  check_components();
  check_bound_tree();
  // Note [Following a plan]: each ordinal names the op that has it (or -1: compacted away), in order.
  if (int64_t(plan_op_.size()) != (fp_on_ ? ordinal_ : 0)) fail("an op without an ordinal while fingerprinting");
  for (size_t k = 0; k < plan_op_.size(); ++k) {
    const int o = plan_op_[k];
    if (o < -1 || o >= int(ops_.size()) || (o >= 0 && ops_[o].ordinal != int64_t(k)))
      fail("ordinal " + std::to_string(k) + " does not name its op");
  }
  if (fp_keep_ && int64_t(fps_.size()) != ordinal_) fail("an op without a fingerprint");
}

// Every tensor's storage and op are in range, and it is its op's output and in its storage's list.
void Core::check_tensor_ids() const {
  const int nt = int(tensors_.size()), no = int(ops_.size()), ns = int(storages_.size());
  for (int t = 0; t < nt; ++t) {
    const Tensor& x = tensors_[t];
    const std::string name = "tensor " + std::to_string(t);
    if (!in(x.storage, ns) || !in(x.op, no)) fail(name + ": storage or op out of range");
    const Op& op = ops_[x.op];
    if (!in(x.index, int(op.outputs.size())) || op.outputs[x.index] != t) fail(name + ": not its op's output");
    if (!contains(storages_[x.storage].tensors, t)) fail(name + ": missing from its storage's tensors");
  }
}

// Every op's outputs are its own and its inputs in range; an op not collected reads no collected
// storage. Returns, per tensor, whether an op that is not collected reads it.
std::vector<char> Core::check_op_ids() const {
  const int nt = int(tensors_.size()), no = int(ops_.size());
  std::vector<char> read_live(nt, 0);
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
  return read_live;
}

// A collected op is never computed again (Note [Collection and compaction]):
// each output is gone for good, defined on a constant, or an undefined tensor
// of a dead constant that nothing asks for (unreferenced, read by no op that
// is not collected: a tensor is only recomputed when required or as an
// undefined input of an op being recomputed).
void Core::check_collected_ops(const std::vector<char>& read_live) const {
  for (int o = 0; o < int(ops_.size()); ++o) {
    const Op& op = ops_[o];
    if (!op.collected) continue;
    for (int t : op.outputs) {
      const Tensor& x = tensors_[t];
      const Storage& s = storages_[x.storage];
      if (s.collected || s.banished || (s.pinned && (x.defined || (x.refs == 0 && !read_live[t])))) continue;
      fail("op " + std::to_string(o) + ": collected, but its output " + std::to_string(t) + " may be recomputed");
    }
  }
}

// Every storage's ids are in range and its edges mirrored; a collected storage is freed, banished
// and node-less; the counts of collected and pooled storages are right.
void Core::check_storage_ids() const {
  const int nt = int(tensors_.size()), no = int(ops_.size()), ns = int(storages_.size());
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
}

// Each storage's state (pool, locks, pins, eqclass node, tensors, refs, cached cost, count of
// neighbours with a node), then the memory counters.
void Core::check_storages() const {
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
    if (s.need != 0) fail(name + ": needed by a plan between instructions (Note [Planned recomputation])");
    if (s.bringing != 0) fail(name + ": locked by a bring-back between instructions (Note [The order of a bring-back])");
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
  for (int sid = 0; sid < int(storages_.size()); ++sid)
    if (storages_[sid].handed) fail("storage " + std::to_string(sid) + " still handed over between calls");
  if (mem != c_.memory) fail("memory counter " + std::to_string(c_.memory) + " != resident bytes " + std::to_string(mem));
  if (c_.peak_memory < c_.memory) fail("peak below current memory");
  if (cfg_.budget >= 0 && c_.memory > cfg_.budget) fail("memory above budget");
}

// The union-find's nodes: parents in range, and every evicted storage owns its node (splitting
// rewires a member's node). With eqclass_split, the components are exact (Note [Splitting
// eqclass components]): members are the storages with a node; each root's value is the sum of
// its members' costs; members joined by an edge share a root; and a root's members are
// connected (one walk from any of them reaches them all). O(storages + edges).
void Core::check_components() const {
  const int ns = int(storages_.size());
  for (size_t r = 0; r < uf_.size(); ++r)
    if (uf_[r].parent < 0 || uf_[r].parent >= int(uf_.size())) fail("union-find parent out of range");
  std::vector<char> owned(uf_.size(), 0);
  for (int sid = 0; sid < ns; ++sid) {
    const int n = storages_[sid].uf;
    if (n < 0) continue;
    if (owned[n]) fail("storage " + std::to_string(sid) + " shares its eqclass node with another storage");
    owned[n] = 1;
  }
  if (cfg_.cost != CostMode::EqClass || !cfg_.semantics.eqclass_split) return;
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

// The bound tree (Note [Choosing without scanning]): every pool member has its
// leaf, and a leaf not queued for a refresh holds no more than its bound.
void Core::check_bound_tree() const {
  if (!bt_on_) return;
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

}  // namespace dtr
