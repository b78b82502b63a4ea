// core_eqclass.cpp - evicted neighbourhoods: the union-find components of eqclass (with exact
// splitting) and dtr's exact e*.
#include "core_internal.h"

namespace dtr {

// ---------------------------------------------------------------------------
// Evicted neighbourhoods

// (uf_find() is in core_internal.h.)

// uf_find without path compression or counting (check(), compact()).
int Core::uf_root(int n) const {
  while (uf_[n].parent != n) n = uf_[n].parent;
  return n;
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

// The state of uf_leave()'s searches, one per seed.
struct Core::UFSplit {
  std::vector<std::vector<int>> stack, members;  // per search: storages to scan, storages found
  std::vector<int> group;        // union-find over the searches: those that met
  std::vector<int64_t> pending;  // per group (at its root): storages found, not yet scanned
  std::vector<double> sum;       // per group: the costs of the storages found
  int find(int i) {
    while (group[i] != i) i = group[i] = group[group[i]];
    return i;
  }
};

void Core::uf_leave(int sid) {
  Storage& s = storages_[sid];
  if (s.uf < 0) return;
  bt_touch_nbrs(sid);
  const int root = uf_find(s.uf);
  const double cost = s.cost;
  const int nbr_edges = s.uf_nbrs;
  s.uf = -1;
  count_uf_nbrs(sid, -1);
  if (!cfg_.semantics.eqclass_split || nbr_edges <= 1) {
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
  if (seeds.size() <= 1) {
    uf_[root].value -= cost;
    bt_walk(root);
    return;
  }
  UFSplit split = uf_split_search(seeds, base);
  uf_split_off(split, root, cost);
  bt_walk(root);  // the pieces split off have fresh roots: their neighbours register there again
}

// Runs the searches from `seeds` (labelled base + i) in lockstep until at most
// one group of them has storages left to scan.
Core::UFSplit Core::uf_split_search(const std::vector<int>& seeds, uint64_t base) {
  const int k = int(seeds.size());
  UFSplit sp;
  sp.stack.resize(k);
  sp.members.resize(k);
  sp.group.resize(k);
  sp.pending.resize(k);
  sp.sum.resize(k);
  for (int i = 0; i < k; ++i) {
    sp.stack[i].assign(1, seeds[i]);
    sp.members[i].assign(1, seeds[i]);
    sp.group[i] = i;
    sp.pending[i] = 1;
    sp.sum[i] = storages_[seeds[i]].cost;
  }
  int alive = k;  // groups with storages left to scan
  while (alive > 1) {
    for (int i = 0; i < k && alive > 1; ++i) {
      if (sp.stack[i].empty()) continue;
      const int x = sp.stack[i].back();
      sp.stack[i].pop_back();
      int g = sp.find(i);
      sp.pending[g] -= 1;
      for (int dir = 0; dir < 2; ++dir)
        for (int n : dir == 0 ? storages_[x].deps : storages_[x].dependents) {
          Storage& ns = storages_[n];
          c_.storage_accesses += 1;
          if (ns.uf < 0) continue;
          if (ns.mark >= base && ns.mark < base + uint64_t(k)) {
            const int h = sp.find(int(ns.mark - base));
            if (h == g) continue;
            if (sp.pending[h] > 0) alive -= 1;  // two searches met: one group
            sp.group[h] = g;
            sp.pending[g] += sp.pending[h];
            sp.sum[g] += sp.sum[h];
            continue;
          }
          ns.mark = base + uint64_t(i);
          sp.stack[i].push_back(n);
          sp.members[i].push_back(n);
          sp.pending[g] += 1;
          sp.sum[g] += ns.cost;
        }
      if (sp.pending[g] == 0) alive -= 1;  // a whole piece: nothing more joins it
    }
  }
  return sp;
}

// The one group still searching (or, if none is, the last piece) keeps the
// old root, whose value loses the leaver's `cost` and the pieces split off;
// every other group is a finished piece and gets fresh nodes (the old nodes of
// its members may still be on the paths of the storages that keep the root).
void Core::uf_split_off(UFSplit& sp, int root, double cost) {
  const int k = int(sp.group.size());
  int keep = -1;
  for (int i = 0; i < k; ++i)
    if (sp.find(i) == i && (keep < 0 || sp.pending[i] > 0)) keep = i;
  double split_off = 0;
  std::vector<int> fresh_root(k, -1);
  for (int i = 0; i < k; ++i) {
    const int g = sp.find(i);
    if (g == keep) continue;
    if (fresh_root[g] < 0) {
      fresh_root[g] = int(uf_.size());
      uf_.push_back(UFNode{fresh_root[g], sp.sum[g]});
      split_off += sp.sum[g];
    }
    for (int m : sp.members[i]) {
      const int node = int(uf_.size());
      uf_.push_back(UFNode{fresh_root[g], 0.0});
      storages_[m].uf = node;
    }
  }
  if (keep >= 0 && sp.pending[keep] == 0) uf_[root].value = sp.sum[keep];  // all pieces finished: exact sum
  else uf_[root].value -= cost + split_off;
}

void Core::uf_leave_all(const std::vector<int>& sids) {
  if (!cfg_.semantics.eqclass_split) {
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
  for (int dir = 0; dir < 2; ++dir)
    for (int n : dir == 0 ? s.deps : s.dependents) {
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

double Core::neighbourhood_cost(int sid) {
  switch (cfg_.cost) {
    case CostMode::EqClass: return eqclass_cost(sid);
    case CostMode::Full: return full_cost(sid);
    default: return 0.0;
  }
}

}  // namespace dtr
