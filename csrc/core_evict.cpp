// core_evict.cpp - eviction: the pool, choosing a victim (by a scan or the bound tree),
// evicting and banishing.
#include "core_internal.h"

#include <cmath>

namespace dtr {

// ---------------------------------------------------------------------------
// Eviction

void Core::make_room(int64_t bytes) {
  if (cfg_.budget < 0) return;
  while (c_.memory + bytes > cfg_.budget) {
    if (pool_.empty()) throw out_of_memory(bytes);
    evict(choose(), /*by_heuristic=*/true);
  }
}

// Note [What filled the budget]
// "Out of budget: N bytes needed" cannot be acted on: it does not say whether
// the memory was the program's own (weights, gradients it kept, copies it
// made) or dtr's, nor whether evicting more would have helped. When no
// eviction can make room, every resident storage is unevictable (the pool is
// empty), and each is so for a reason the core knows: pinned (a constant, a
// storage protect() pinned, or one the driver pinned, with the reason it gave
// to pin()), or locked (an input of the op whose room is being made, read by a
// recomputation in progress, or locked by the driver). The report lists them
// all, largest first, with the op being begun and the op being recomputed, so
// that the driver can say what filled the budget in its own terms.
OutOfMemory Core::out_of_memory(int64_t bytes) const {
  OutOfMemory e(c_.memory + bytes, cfg_.budget);
  e.request = bytes;
  e.op = current_op_;
  std::vector<char> input;  // storages the op being begun reads
  if (current_op_ >= 0) {
    input.assign(storages_.size(), 0);
    for (int p : ops_[current_op_].inputs) input[tensors_[p].storage] = 1;
  }
  for (int sid = 0; sid < int(storages_.size()); ++sid) {
    const Storage& s = storages_[sid];
    if (!s.resident) continue;
    if (s.pool_pos >= 0) {
      e.evictable += s.size;
      continue;
    }
    Hold why = s.pinned ? s.pin_reason
               : s.bringing > 0 ? bringing_why_  // (locked by pin_many until all are back)
               : (!input.empty() && input[sid]) ? Hold::Input
               : plan_depth_ > 0 ? Hold::Recompute : Hold::Locked;
    e.held.push_back(Held{sid, s.size, why, s.refs > 0});
    if (s.wanted > 0 && !s.pinned && why != Hold::Input) e.held.back().why = Hold::Recompute;
  }
  std::stable_sort(e.held.begin(), e.held.end(), [](const Held& a, const Held& b) { return a.size > b.size; });
  return e;
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

void Core::bt_clear() {
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
  bt_on_ = false;
}

void Core::bt_sync() {
  const bool want = bounds_exact();
  if (want == bt_on_) return;
  bt_clear();
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
  if (cfg_.semantics.eqclass_split && s.uf >= 0) uf_leave(sid);
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

}  // namespace dtr
