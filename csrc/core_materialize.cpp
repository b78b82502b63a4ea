// core_materialize.cpp - (re)materialization: require, pin, protect, the explicit-stack recursion
// that recomputes evicted inputs, and computing an op.
#include "core_internal.h"
#include "depth_pool.h"

namespace dtr {

// ---------------------------------------------------------------------------
// (Re)materialization

void Core::require(int t) {
  check_alive_input(t, "require");
  if (!tensors_.at(t).defined) materialize(t, /*remat=*/true);
}

void Core::pin(int t, Hold why) {
  require(t);
  Storage& s = storages_[tensors_[t].storage];
  if (s.pinned) return;
  lock(tensors_[t].storage);
  s.pinned = true;
  s.pin_reason = why;
  if (on_pin) on_pin(tensors_[t].storage);
}

void Core::pin_many(const std::vector<int>& ts, Hold why) {
  for (int t : ts) check_alive_input(t, "pin");
  std::vector<int> evicted;  // (Note [The order of a bring-back])
  for (int t : ts)
    if (!tensors_[t].defined) evicted.push_back(t);
  try {
    bring_back(ts, {}, why);
  } catch (OutOfMemory&) {
    if (evicted.size() < 2) throw;
    std::stable_sort(evicted.begin(), evicted.end(), [this](int a, int b) {
      return storages_[tensors_[a].storage].size > storages_[tensors_[b].storage].size;
    });
    std::vector<int> first;
    for (int t : ts)
      if (!contains(evicted, t)) first.push_back(t);
    bring_back(first, evicted, why);
  }
  for (int t : ts) pin(t, why);  // (all resident now: pinning recomputes nothing)
}

// Note [The order of a bring-back]
// pin_many() brings back several tensors that must all end resident (the end
// of a block: everything the program holds). Each target is locked once it
// is resident, so that bringing back the next cannot evict it; the locks
// become pins when all are back, and are given back if one cannot come back.
// The first attempt takes the targets in the given order (the resident ones
// are then locked where they stand). If it runs out of budget, a second
// attempt locks the targets that were resident when pin_many began, and
// brings back those that were not largest storage first: each one's
// recomputation runs with the earlier ones locked, so its peak is what is
// locked so far plus its own working set, which includes its own bytes; the
// largest are best run while the least is locked, and what the first attempt
// brought back is evictable again until its turn. On the paper's UNet a 9 MiB
// weight gradient came back before an 18 MiB one, whose recomputation then
// passed a budget the whole step had fitted (issue 32); in a step whose
// smaller targets feed the larger ones, the given order is the better one.
// Both attempts are the core's, so a replay of the block brings back the
// same way. A thrashing attempt is not tried again.
void Core::bring_back(const std::vector<int>& first, const std::vector<int>& then, Hold why) {
  std::vector<int> locked;  // storages this call locked, once per lock
  auto hold = [&](int t) {
    const int sid = tensors_[t].storage;
    lock(sid);
    storages_[sid].bringing += 1;
    locked.push_back(sid);
  };
  auto give_back = [&]() {
    for (int sid : locked) {
      storages_[sid].bringing -= 1;
      unlock(sid);
    }
  };
  bringing_why_ = why;
  // One plan for all of them (Note [Planned recomputation]): the outermost materialization is this call.
  const bool outer = plan_depth_ == 0;
  ++plan_depth_;
  try {
    for (int t : first) plan(t);
    for (int t : then) plan(t);
    for (int t : first) {
      require(t);
      hold(t);
    }
    for (int t : then) {
      require(t);
      hold(t);
    }
  } catch (...) {
    give_back();
    --plan_depth_;
    if (outer) end_plan();
    throw;
  }
  give_back();
  --plan_depth_;
  if (outer) end_plan();
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
    if (!storages_[d].pinned) pin(storages_[d].root, Hold::Protected);
    const std::vector<int> tensors = storages_[d].tensors;
    for (int t : tensors)
      if (tensors_[t].refs > 0 && !tensors_[t].defined) require(t);
  }
}

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

// Note [Planned recomputation]
// With Config::keep_needed, a recomputed storage nobody references is freed
// as soon as nothing evicted and referenced (or being recomputed right now)
// needs it (Note [Freeing what an evicted tensor needs] in core_graph.cpp).
// Within one materialization that was too soon: an input recomputed for one
// pending input was freed before a sibling's recomputation read it again, so
// a graph of diamonds (y_i = f(p_i, q_i), p_i and q_i both computed from
// y_{i-1}) recomputed y_{i-1} twice per level: 2^n recomputations for n
// levels. A KV cache makes such diamonds (each step's keys and values are
// computed from the cache and concatenated onto it), and generating 40 tokens
// under a budget ran for ever. So the outermost materialization first plans
// what it will run: the undefined tensors its target needs, transitively, and
// their ops. Each storage counts the planned ops that will read it (`need`),
// and is not freed while that count is positive; an op's reads leave the count
// when it runs (plan_done), and whatever is left when the outermost
// materialization ends (it failed, or a sibling's recomputation made a planned
// op unnecessary) leaves then, freeing what is no longer needed. A planned
// storage stays in the eviction pool, so under a budget the heuristic may
// still evict it: then it is recomputed again, as before, and the thrash limit
// bounds how often (Note [Counting recomputations] in core.h). Without
// evictions every planned op runs at most once: the work of one
// materialization is linear in what it recomputes. pin_many() plans all its
// targets at once (the end of a block brings back everything the program
// holds as one materialization). Planning costs a walk of what is recomputed
// anyway; an op whose inputs are all defined plans nothing.

void Core::plan(int t0) {
  if (tensors_[t0].defined) return;
  std::vector<int> stack{t0};
  while (!stack.empty()) {
    const int t = stack.back();
    stack.pop_back();
    Op& op = ops_[tensors_[t].op];
    if (op.planned) continue;
    op.planned = true;
    planned_ops_.push_back(tensors_[t].op);
    for (int p : op.inputs) {
      storages_[tensors_[p].storage].need += 1;
      if (!tensors_[p].defined) stack.push_back(p);
    }
  }
}

void Core::plan_done(int op_id) {
  Op& op = ops_[op_id];
  if (!op.planned) return;
  op.planned = false;
  for (int p : op.inputs) storages_[tensors_[p].storage].need -= 1;
}

void Core::end_plan() {
  std::vector<int> ops;
  ops.swap(planned_ops_);
  std::vector<int> freed;  // inputs whose count fell to 0 only now: they may go
  for (int o : ops) {
    if (!ops_[o].planned) continue;
    plan_done(o);
    for (int p : ops_[o].inputs)
      if (storages_[tensors_[p].storage].need == 0) freed.push_back(tensors_[p].storage);
  }
  if (cfg_.semantics.keep_needed && !cfg_.banish)
    for (int sid : freed) free_if_unneeded(sid);
}

// Note [Deepest input first]
// A frame holds every input it already has (locked) while it recomputes the
// next pending one, so the order of the pending inputs decides how much is
// held during a deep recursion. In a Python-loop LSTM, the gates of step t are
// add(x_t @ W_x, h_{t-1} @ W_h): in input order the x projection (cheap, from
// constants) comes back first and stays locked while the recursion walks back
// through h_{t-1}, h_{t-2}, ... -- one such buffer per level, seven of them
// (896 KiB of a 1.24 MiB budget) in tests/runtime/test_runtime_models.py's LSTM at 35%,
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

// One level of materialize()'s explicit stack: tensor t is being (re)computed
// once its pending inputs are back.
struct Core::Frame {
  int t;
  bool remat;
  std::vector<int> pending;  // inputs that were undefined when the frame began
  size_t i;                  // pending[0, i) are back and locked
  bool waiting;              // the child for pending[i] is on the stack
  bool released = false;     // finish() gave its locks back
};

// A frame for tensor t: its inputs' storages are touched, the defined ones
// locked, and the undefined ones are pending (Note [Deepest input first]).
void Core::push_frame(std::vector<Frame>& stack, int t, bool remat) {
  const Op& op = ops_[tensors_[t].op];
  if (op.collected) throw std::logic_error("recomputing collected op " + std::to_string(tensors_[t].op));
  touch_parents(tensors_[t].op);
  storages_[tensors_[t].storage].wanted += 1;
  Frame f{t, remat, {}, 0, false};
  for (int p : op.inputs)
    if (tensors_[p].defined) lock(tensors_[p].storage);
  for (int p : op.inputs)
    if (!tensors_[p].defined) f.pending.push_back(p);
  if (cfg_.semantics.deep_first && f.pending.size() > 1)
    std::stable_partition(f.pending.begin(), f.pending.end(), [&](int p) { return needs_recursion(p); });
  stack.push_back(std::move(f));
}

void Core::materialize(int t0, bool remat0, bool stop_before_root) {
  // (kept between calls, so that its capacity stays: Note [Scratch by nesting depth] in depth_pool.h)
  DepthLease<std::vector<Frame>> lease;
  std::vector<Frame>& stack = *lease;
  stack.clear();
  const bool outer = plan_depth_ == 0;  // see Note [Planned recomputation]
  ++plan_depth_;
  try {
    bool recomputes = !stop_before_root;
    for (int p : ops_[tensors_[t0].op].inputs) recomputes = recomputes || !tensors_[p].defined;
    if (recomputes) plan(t0);  // (an op whose inputs are all there plans nothing: the common case)
    push_frame(stack, t0, remat0);
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
          push_frame(stack, p, true);  // invalidates f
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
        break;
      }
      const int64_t handed = remat ? mark_handover(op_id) : 0;
      try {
        make_room(ops_[op_id].total_size - handed);
      } catch (OutOfMemory& e) {  // (the report names the op being recomputed: Note [What filled the budget])
        if (remat) e.remat_op = op_id;
        throw;
      }
      compute(t, remat);
      stack.back().released = true;
      finish(op_id);  // (still wanted here: its unlocks must not free what it just computed)
      stack.pop_back();
      storages_[tensors_[t].storage].wanted -= 1;
    }
  } catch (...) {  // out of memory, thrashing or a failed recomputation
    abandon_frames(stack);
    --plan_depth_;
    if (outer) end_plan();
    throw;
  }
  --plan_depth_;
  if (outer) end_plan();
}

// materialize() failed: each frame left on the stack gives back what it took.
void Core::abandon_frames(const std::vector<Frame>& stack) {
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
// writes), and no other planned recomputation of the same materialization
// will read it (its `need` is this op's own read at most: Note [Planned
// recomputation]; without that check, a bring-back whose targets shared an
// old version handed it over and recomputed it again for each of them, and
// random program 26 recomputed for minutes at the end of its block). Then
// room is made for the outputs less the handed bytes, the memory counter
// grows by the same amount, and the old version is evicted
// right after the op (finish), freeing nothing: its bytes are the new
// version's. The driver sees Core::handed(s) during on_compute and moves the
// buffer instead of copying it; a replay's trace reports the free before the
// op, which is how a static schedule says "handed over" (Note [In-place writes
// in a schedule] in dtr.sim.schedule). An old version needed later is
// recomputed like any evicted storage.
int64_t Core::mark_handover(int op_id) {
  if (!cfg_.semantics.inplace_handover) return 0;
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
    if (so.need > (op.planned ? 1 : 0)) continue;  // another planned recomputation reads it (see the Note)
    so.handed = true;
    bytes += so.size;
  }
  return bytes;
}

void Core::finish(int op_id) {
  plan_done(op_id);  // (before the unlocks, which free what nothing needs any more)
  for (int p : ops_[op_id].inputs) unlock(tensors_[p].storage);
  for (int p : ops_[op_id].inputs) {  // see Note [Handing bytes over on recomputation]
    const int sid = tensors_[p].storage;
    if (storages_[sid].handed && storages_[sid].resident) evict(sid, /*by_heuristic=*/false);
  }
  for (int p : ops_[op_id].inputs)  // an input waiting for its dependents to come back
    if (storages_[tensors_[p].storage].banish_pending) try_banish(tensors_[p].storage);
  check_thrash();
}

double Core::remat_allowed() const {
  return std::min(cfg_.remat_limit,
                  remat_allowance(cfg_.thrash_limit, cfg_.thrash_base >= 0 ? cfg_.thrash_base : c_.base_compute));
}

int64_t Core::remats_allowed() const {
  return remat_count_allowance(cfg_.thrash_limit, cfg_.thrash_base_ops >= 0 ? cfg_.thrash_base_ops : c_.base_ops);
}

void Core::check_thrash() const {
  if (std::isinf(cfg_.thrash_limit) && std::isinf(cfg_.remat_limit)) return;
  const double allowed = remat_allowed();
  const int64_t n_allowed = remats_allowed();
  if (c_.remat_compute > allowed || c_.remats > n_allowed) throw Thrashing(c_.remat_compute, allowed, c_.remats, n_allowed);
}

void Core::compute(int t, bool remat) {
  const int op_id = tensors_[t].op;
  const Op& op = ops_[op_id];
  if (on_compute && (remat || compute_hook_first)) on_compute(op_id, remat);
  clock_ += op.cost;
  if (remat) {
    c_.remat_compute += op.cost;
    c_.remats += 1;
  } else {
    c_.base_compute += op.cost;
    c_.base_ops += 1;
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
  // The storages that become resident now (on the stack for an op of a few outputs: this runs for every op).
  constexpr size_t kSmall = 8;
  int fresh_small[kSmall];
  std::vector<int> fresh_big;
  int* fresh = fresh_small;
  if (op.outputs.size() > kSmall) {
    fresh_big.resize(op.outputs.size());
    fresh = fresh_big.data();
  }
  size_t n_fresh = 0;
  for (int u : op.outputs) {
    Storage& s = storages_[tensors_[u].storage];
    if (s.banished) {  // a banished sibling is recomputed too, and freed at once
      c_.memory -= op.sizes[tensors_[u].index];
      continue;
    }
    if (!s.resident) {
      s.resident = true;
      fresh[n_fresh++] = tensors_[u].storage;
    }
    tensors_[u].defined = true;
  }
  for (size_t i = 0; i < n_fresh; ++i) {
    const int sid = fresh[i];
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

}  // namespace dtr
