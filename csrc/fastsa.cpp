// fastsa.cpp - the annealing loop of FastSA (see fastsa.h and Note [FastSA] in dtr/sim/planners/fastsa.py).
#include "fastsa.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

namespace dtr {
namespace {

// Range add / a global fold over A[0, n) (iterative, no lazy propagation: d[i] is what was added to
// the whole subtree of internal node i, t[i] the fold of its subtree including d[i]). Fold::join is an
// associative "max-like" operation over which adding a constant distributes: max, or (fastsa.txt
// appendix C.2) base-2 log-sum-exp, a smooth peak that feels every high slot, not only the highest.
template <class T, class Fold>
class RangeAddTree {
 public:
  RangeAddTree(int n, T init) {
    size_ = 1;
    while (size_ < std::max(1, n)) size_ *= 2;
    t_.assign(2 * size_, init);
    d_.assign(size_, T(0));
    for (int i = size_ - 1; i >= 1; --i) t_[i] = Fold::join(t_[2 * i], t_[2 * i + 1]);
  }
  // A[lo..hi] += v (inclusive).
  void add(int lo, int hi, T v) {
    if (lo > hi || v == T(0)) return;
    int l = lo + size_, r = hi + 1 + size_;
    const int l0 = l, r0 = r - 1;
    while (l < r) {
      if (l & 1) {
        t_[l] += v;
        if (l < size_) d_[l] += v;
        ++l;
      }
      if (r & 1) {
        --r;
        t_[r] += v;
        if (r < size_) d_[r] += v;
      }
      l >>= 1;
      r >>= 1;
    }
    pull(l0 >> 1);
    pull(r0 >> 1);
  }
  T value() const { return t_[1]; }

 private:
  void pull(int i) {
    for (; i >= 1; i >>= 1) t_[i] = Fold::join(t_[2 * i], t_[2 * i + 1]) + d_[i];
  }
  int size_;
  std::vector<T> t_, d_;
};

struct MaxFold {
  static int64_t join(int64_t a, int64_t b) { return std::max(a, b); }
};
struct LseFold {
  static double join(double a, double b) {
    const double m = std::max(a, b);
    return m + std::log2(1.0 + std::exp2(-std::fabs(a - b)));
  }
};
using AddMaxTree = RangeAddTree<int64_t, MaxFold>;
using AddLseTree = RangeAddTree<double, LseFold>;

// A nop slot's offset in the log-sum-exp tree (C.2: only slots that run a unit can hold the peak).
constexpr double kNopOffset = 1e6;

// Insert into / erase from a sorted vector.
void sorted_insert(std::vector<int>& v, int x) { v.insert(std::lower_bound(v.begin(), v.end(), x), x); }
void sorted_erase(std::vector<int>& v, int x) {
  auto it = std::lower_bound(v.begin(), v.end(), x);
  if (it != v.end() && *it == x) v.erase(it);
}

class State {
 public:
  State(const FastsaProblem& p, std::vector<int> slots, double soft_scale)
      : p_(p), slots_(std::move(slots)), T_(static_cast<int>(slots_.size())), tree_(T_, 0),
        soft_(soft_scale > 0 ? T_ : 1, -kNopOffset), scale_(soft_scale) {
    const int n = static_cast<int>(p.cost.size());
    const int nv = static_cast<int>(p.size.size());
    prod_.resize(n);
    uses_.resize(nv);
    producer_.assign(nv, -1);
    for (int u = 0; u < n; ++u)
      for (int k = p.out_ptr[u]; k < p.out_ptr[u + 1]; ++k) {
        if (producer_[p.out_idx[k]] >= 0) throw std::invalid_argument("fastsa: a value with two producers");
        producer_[p.out_idx[k]] = u;
      }
    for (int t = 0; t < T_; ++t) {
      const int u = slots_[t];
      if (u < 0) continue;
      if (u >= n) throw std::invalid_argument("fastsa: slot " + std::to_string(t) + " holds no unit");
      prod_[u].push_back(t);
      for (int k = p.in_ptr[u]; k < p.in_ptr[u + 1]; ++k) {
        const int v = p.in_idx[k];
        if (producer_[v] < 0 || prod_[producer_[v]].empty())
          throw std::invalid_argument("fastsa: the start reads a value before producing it");
        uses_[v].push_back(t);
      }
      range_add(t, t, p.extra[u]);
      if (scale_ > 0) soft_.add(t, t, kNopOffset);
      cost_ += p.cost[u];
    }
    for (int v = 0; v < nv; ++v) {
      if (producer_[v] < 0) continue;
      for (size_t i = 0; i < prod_[producer_[v]].size(); ++i) range_add(prod_[producer_[v]][i], end_of(v, i), p.size[v]);
    }
  }

  int64_t peak() const { return tree_.value(); }
  // The smooth peak of appendix C.2 in bytes (the peak itself without a soft scale).
  double soft_peak() const { return scale_ > 0 ? soft_.value() / scale_ : static_cast<double>(tree_.value()); }
  double cost() const { return cost_; }
  int T() const { return T_; }
  int slot(int t) const { return slots_[t]; }
  const std::vector<int>& slots() const { return slots_; }
  bool fixed(int u) const { return p_.unit_flags[u] & kFastsaFixed; }
  int first(int u) const { return prod_[u].empty() ? -1 : prod_[u][0]; }

  bool can_add(int u, int t) const {
    if (slots_[t] >= 0 || fixed(u)) return false;
    for (int k = p_.in_ptr[u]; k < p_.in_ptr[u + 1]; ++k) {
      const std::vector<int>& pd = prod_[producer_[p_.in_idx[k]]];
      if (pd.empty() || pd[0] >= t) return false;
    }
    return true;
  }

  bool can_remove(int t) const {
    const int u = slots_[t];
    if (u < 0 || fixed(u)) return false;
    const std::vector<int>& pu = prod_[u];
    if (pu.size() < 2) return false;  // every unit keeps one computation
    if (pu[0] != t) return true;      // an earlier production serves its reads
    for (int k = p_.out_ptr[u]; k < p_.out_ptr[u + 1]; ++k) {
      const std::vector<int>& us = uses_[p_.out_idx[k]];
      auto it = std::upper_bound(us.begin(), us.end(), t);
      if (it != us.end() && *it < pu[1]) return false;
    }
    return true;
  }

  // u's first computation lies between its neighbours' (units in order: a program runs each op once, in
  // order, so a schedule a runtime step can follow keeps them so; Note [Schedules a step can follow]).
  bool in_order(int u) const {
    const int n = static_cast<int>(prod_.size());
    const int f = prod_[u][0];
    return (u == 0 || prod_[u - 1][0] < f) && (u + 1 == n || f < prod_[u + 1][0]);
  }

  // Every read of u's values comes after some production of u.
  bool reads_served(int u) const {
    for (int k = p_.out_ptr[u]; k < p_.out_ptr[u + 1]; ++k) {
      const std::vector<int>& us = uses_[p_.out_idx[k]];
      if (!us.empty() && (prod_[u].empty() || prod_[u][0] > us[0])) return false;
    }
    return true;
  }

  void add(int u, int t) {
    slots_[t] = u;
    range_add(t, t, p_.extra[u]);
    if (scale_ > 0) soft_.add(t, t, kNopOffset);
    cost_ += p_.cost[u];
    change_prod(u, t, true);
    for (int k = p_.in_ptr[u]; k < p_.in_ptr[u + 1]; ++k) change_use(p_.in_idx[k], t, true);
  }

  void remove(int t) {
    const int u = slots_[t];
    slots_[t] = -1;
    range_add(t, t, -p_.extra[u]);
    if (scale_ > 0) soft_.add(t, t, -kNopOffset);
    cost_ -= p_.cost[u];
    change_prod(u, t, false);
    for (int k = p_.in_ptr[u]; k < p_.in_ptr[u + 1]; ++k) change_use(p_.in_idx[k], t, false);
  }

 private:
  void range_add(int lo, int hi, int64_t v) {
    tree_.add(lo, hi, v);
    if (scale_ > 0) soft_.add(lo, hi, static_cast<double>(v) * scale_);
  }

  // The last slot of production i of value v (its life interval is [production, end_of(v, i)]).
  int end_of(int v, size_t i) const {
    const std::vector<int>& pv = prod_[producer_[v]];
    const int p = pv[i];
    const uint8_t f = p_.value_flags[v];
    if (f & kFastsaPinned) return T_ - 1;
    const bool last = i + 1 == pv.size();
    if (last && (f & kFastsaKeep)) return T_ - 1;
    const int nxt = last ? T_ : pv[i + 1];
    const std::vector<int>& us = uses_[v];
    auto it = std::lower_bound(us.begin(), us.end(), nxt);
    if (it == us.begin()) return p;
    --it;
    return *it > p ? *it : p;
  }

  // Index of the production of v governing slot t (the last one at or before t), or -1.
  int governing(int v, int t) const {
    const std::vector<int>& pv = prod_[producer_[v]];
    auto it = std::upper_bound(pv.begin(), pv.end(), t);
    return it == pv.begin() ? -1 : static_cast<int>(it - pv.begin()) - 1;
  }

  // The intervals of v's productions that a change at slot t may touch (the one governing t - 1, and the
  // one at t if any), added to the tree with sign s.
  void apply_around(int v, int t, int64_t s) {
    const int64_t m = p_.size[v] * s;
    const int a = governing(v, t - 1);
    const std::vector<int>& pv = prod_[producer_[v]];
    if (a >= 0) range_add(pv[a], end_of(v, a), m);
    const int b = governing(v, t);
    if (b >= 0 && b != a) range_add(pv[b], end_of(v, b), m);
  }

  void change_prod(int u, int t, bool add) {
    for (int k = p_.out_ptr[u]; k < p_.out_ptr[u + 1]; ++k) apply_around(p_.out_idx[k], t, -1);
    if (add) sorted_insert(prod_[u], t); else sorted_erase(prod_[u], t);
    for (int k = p_.out_ptr[u]; k < p_.out_ptr[u + 1]; ++k) apply_around(p_.out_idx[k], t, +1);
  }

  void change_use(int v, int t, bool add) {
    const bool pinned = p_.value_flags[v] & kFastsaPinned;  // (its interval does not depend on its reads)
    if (!pinned) apply_around(v, t, -1);
    if (add) sorted_insert(uses_[v], t); else sorted_erase(uses_[v], t);
    if (!pinned) apply_around(v, t, +1);
  }

  const FastsaProblem& p_;
  std::vector<int> slots_;
  int T_;
  AddMaxTree tree_;
  AddLseTree soft_;
  double scale_;
  std::vector<std::vector<int>> prod_;  // per unit, its slots
  std::vector<std::vector<int>> uses_;  // per value, the slots that read it
  std::vector<int> producer_;           // per value, its unit
  double cost_ = 0;
};

// One primitive change of a mutation (for undo, and for the journal of the best state).
struct Change {
  bool added;
  int unit, slot;
};

}  // namespace

FastsaResult fastsa_anneal(const FastsaProblem& p, std::vector<int> slots, const FastsaParams& par) {
  const int n = static_cast<int>(p.cost.size());
  const int nv = static_cast<int>(p.size.size());
  auto csr_ok = [](const std::vector<int>& ptr, const std::vector<int>& idx, int rows, int hi) {
    if (static_cast<int>(ptr.size()) != rows + 1 || ptr[0] != 0 || ptr.back() != static_cast<int>(idx.size()))
      return false;
    for (int r = 0; r < rows; ++r)
      if (ptr[r] > ptr[r + 1]) return false;
    for (int x : idx)
      if (x < 0 || x >= hi) return false;
    return true;
  };
  if (!csr_ok(p.in_ptr, p.in_idx, n, nv) || !csr_ok(p.out_ptr, p.out_idx, n, nv) ||
      static_cast<int>(p.extra.size()) != n || static_cast<int>(p.unit_flags.size()) != n ||
      static_cast<int>(p.value_flags.size()) != nv)
    throw std::invalid_argument("fastsa: inconsistent problem arrays");
  double soft_scale = 0;
  if (par.soft_peak) {  // C.2: sizes rescaled so that the largest value is 10 (base 2)
    int64_t biggest = 1;
    for (int64_t x : p.size) biggest = std::max(biggest, x);
    for (int64_t x : p.extra) biggest = std::max(biggest, x);
    soft_scale = 10.0 / static_cast<double>(biggest);
  }
  State st(p, std::move(slots), soft_scale);
  const int T = st.T();
  if (par.keep_order)
    for (int u = 0; u < n; ++u)
      if (st.first(u) < 0 || !st.in_order(u))
        throw std::invalid_argument("fastsa: keep_order with a start whose first computations are out of order");
  std::vector<int> movable;
  for (int u = 0; u < n; ++u)
    if (!st.fixed(u)) movable.push_back(u);

  const double B = static_cast<double>(std::max<int64_t>(par.budget, 1));
  auto objective = [&](double peak, double cost) { return std::max(B, peak) * cost; };
  FastsaResult res;
  res.peak0 = st.peak();
  res.objective0 = objective(st.soft_peak(), st.cost());
  const double scale = par.temp_scale > 0 ? par.temp_scale : std::max(res.objective0, 1e-300);
  const double h0 = par.temp0 * scale, h1 = par.temp1 * scale;
  // The best state: within the budget and cheapest, else the lowest objective. Copying T slots at each
  // new best slowed long descents several times over, so the best is `best_vec`, or, when `in_journal`,
  // `snap` (a past state) plus the first `best_len` changes accepted since; once the journal passes 2T
  // changes the best is materialized and `snap` restarts from the current state (O(1) per change).
  auto better = [&](bool feas, double c, double f, bool bfeas, double bc, double bf) {
    if (feas != bfeas) return feas;
    return feas ? c < bc : f < bf;
  };
  double cur = res.objective0;
  bool best_feas = st.peak() <= par.budget;
  double best_cost = st.cost(), best_f = cur;
  int64_t best_peak = st.peak();
  std::vector<int> snap = st.slots(), best_vec = snap;
  std::vector<Change> journal;
  size_t best_len = 0;
  bool in_journal = false;
  auto replay_onto = [](std::vector<int>& slots, const std::vector<Change>& j, size_t k) {
    for (size_t i = 0; i < k; ++i) slots[j[i].slot] = j[i].added ? j[i].unit : -1;
  };

  std::mt19937_64 rng(par.seed);
  auto below = [&](uint64_t k) { return static_cast<int>(rng() % k); };
  auto unif = [&]() { return static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0); };
  const auto t_start = std::chrono::steady_clock::now();
  std::vector<Change> log;
  auto undo = [&]() {
    for (auto it = log.rbegin(); it != log.rend(); ++it) {
      if (it->added) st.remove(it->slot); else st.add(it->unit, it->slot);
    }
  };
  auto random_slot = [&](bool want_nop) {
    for (int k = 0; k < 32; ++k) {
      const int t = below(T);
      if ((st.slot(t) < 0) == want_nop) return t;
    }
    return -1;
  };

  const int64_t N = std::max<int64_t>(par.iterations, 1);
  double h = h0;
  int64_t it = 0;
  if (!(par.stop_when_feasible && best_feas) && !movable.empty()) {
    for (; it < par.iterations; ++it) {
      if ((it & 1023) == 0) {
        // progress: the larger of the iterations' and the time limit's, so that a run the time limit
        // cuts short still cools down to its end temperature
        double frac = static_cast<double>(it) / static_cast<double>(N);
        if (par.time_limit > 0) {
          const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
          if (el > par.time_limit) break;
          frac = std::max(frac, el / par.time_limit);
        }
        h = h0 * std::exp(std::log(h1 / h0) * frac);
      }
      log.clear();
      const double r = unif();
      if (r < 0.4) {  // add a computation
        const int u = movable[below(movable.size())];
        const int t = random_slot(true);
        if (t < 0 || !st.can_add(u, t)) continue;
        st.add(u, t);
        log.push_back({true, u, t});
      } else if (r < 0.8) {  // remove one
        const int t = random_slot(false);
        if (t < 0 || !st.can_remove(t)) continue;
        const int u = st.slot(t);
        st.remove(t);
        log.push_back({false, u, t});
      } else {  // rotate: move one computation to a nop slot
        const int t1 = random_slot(false);
        const int t2 = random_slot(true);
        if (t1 < 0 || t2 < 0 || st.slot(t1) < 0 || st.fixed(st.slot(t1))) continue;
        const int u = st.slot(t1);
        st.remove(t1);
        log.push_back({false, u, t1});
        if (!st.can_add(u, t2)) {
          undo();
          continue;
        }
        st.add(u, t2);
        log.push_back({true, u, t2});
        if (!st.reads_served(u)) {  // the moved computation was the first and a read now precedes it
          undo();
          continue;
        }
      }
      if (par.keep_order && !st.in_order(log.back().unit)) {  // a mutation moves one unit's computations
        undo();
        continue;
      }
      const int64_t pk = st.peak();
      const double f = objective(st.soft_peak(), st.cost());
      if (f <= cur || unif() < std::exp(-(f - cur) / h)) {
        ++res.accepted;
        const bool feas = pk <= par.budget;
        journal.insert(journal.end(), log.begin(), log.end());
        if (better(feas, st.cost(), f, best_feas, best_cost, best_f)) {
          best_feas = feas;
          best_cost = st.cost();
          best_f = f;
          best_peak = pk;
          best_len = journal.size();
          in_journal = true;
        }
        if (journal.size() > 2 * static_cast<size_t>(T)) {
          if (in_journal) {
            best_vec = snap;
            replay_onto(best_vec, journal, best_len);
            in_journal = false;
          }
          snap = st.slots();
          journal.clear();
        }
        cur = f;
        if (par.stop_when_feasible && feas) {
          ++it;
          break;
        }
      } else {
        undo();
      }
    }
  }
  if (in_journal) {
    replay_onto(snap, journal, best_len);
    best_vec = std::move(snap);
  }
  res.slots = std::move(best_vec);
  res.iterations = it;
  res.peak = best_peak;
  res.cost = best_cost;
  res.feasible = best_feas;
  res.temp_end = h;
  return res;
}

}  // namespace dtr
