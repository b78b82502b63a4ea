// core_follow.cpp - following a plan made with the whole step known: fingerprints, plan points, divergence.
#include <unordered_set>

#include "core_internal.h"

namespace dtr {

// Note [Following a plan]
// A training loop runs the same step again and again. A planner that saw one
// step whole (dtr.sim.step_plan) knows, before each op of it, which storages
// to free and which ops to recompute so that the step fits the budget with
// the least recomputation. The core follows such a plan in a later step:
// - ops are named by their *ordinal*, the count of ops created since the core
//   began fingerprinting (set_plan, record_fingerprints, before the first
//   op), and a storage by the ordinal of the op that allocates it and its
//   output position. Ids cannot serve: compaction renumbers them, and a
//   step's ids are its own. Constants get no ordinal: which storages from
//   before the block a step declares, and when, is not its structure. The
//   runtime declares at a block's first op every storage the program held at
//   the end of earlier blocks (Note [Constants from earlier blocks] in
//   dtr/runtime/driver.py), so one more loss kept by a trainer shifted every
//   ordinal after it, and a Hugging Face Trainer's steps diverged at their
//   first op every time an epoch began;
// - each op's *fingerprint* is a hash of what begin_call is given: its
//   inputs, each as the ordinal of its op and its output position (a
//   constant by its size), and its outputs' sizes and aliases. Costs are
//   left out (a measured time varies), and so are the new versions an
//   in-place write makes: whether it makes
//   one depends on what is pinned (a written constant keeps its buffer, and
//   protecting one pins what was computed from it), which depends on the
//   run's own evictions. What is left is what the plan depends on: an op
//   that matches has the same place in the graph and allocates the same
//   bytes. The runtime and a replay of its log make the same calls, so they
//   fingerprint a step alike;
// - at each begin_call (the start of every op but a constant), while
//   the ops so far matched, the op's fingerprint is compared with the plan's
//   at its ordinal. The first that differs, or an op past the plan's end,
//   ends the following for the rest of the core's life (plan_diverged_):
//   from there the step runs online, as if there were no plan;
// - while it matches, the plan's steps at that ordinal run before the op is
//   created: "evict" evicts the named storage if it is resident and
//   evictable now (in the pool: not locked, not pinned), "recompute"
//   materializes the named op's undefined outputs if they can be recomputed
//   (recomputable(): nothing their recomputation needs is collected or
//   banished, as a constant the program dropped). A step that names what the run
//   does not have (an op dropped by compact, a storage the program freed)
//   is skipped. Then the op runs as any op does: its inputs are brought back
//   on demand and room is made by the heuristic wherever the plan's
//   evictions did not suffice (a kernel's real sizes, a run that pinned
//   more), so the budget stays a hard bound and a plan can only change which
//   storages are evicted, and when, never a value.
// Planned evictions are counted apart (Counters::planned_evictions): they
// are neither the heuristic's choice nor a last release.

// Note [Sums in place or not]
// Autograd sums two gradients of one tensor in place (old.add_(new)) only
// when it holds the one reference to the old one's tensor and storage
// (torch's InputBuffer reads storage().use_count()), else out of place
// (old + new). dtr's own references move that count with the run's
// evictions: in torch 2.13 (its PyObject preservation, pytorch#166342) a
// Python UntypedStorage, once made for a storage, holds it for the storage's
// life, and the native path makes one only when it evicts or brings back a
// program's storage (Buf.get in dtr/runtime/storage_table.py, from
// Driver._on_evict and the Recomputer), or holds it strongly
// (StorageTable.hold, for what an evicted storage needs; the reference path
// makes one for every output, so it sums out of place always). So
// one step of a loop summed a gradient out of place where the next, which
// followed a plan that evicted other storages, summed it in place: the two
// differ in that op alone (same place in the graph, same inputs, the same
// bytes live after it), yet the second diverged from the first's plan there
// and ran the rest online, and was recorded and planned again; a loop whose
// two kinds of step planned each other alternated and never followed a plan
// to its end. So an op whose one output is a new storage of the size of its
// first input's storage (a + b) fingerprints as a write of that input (a.add_(b)),
// whose new version is left out, as are its inputs' other writes: a plan of
// either step matches the other. Nothing else changes: the ordinals after it
// agree (each names the sum by the op's ordinal and output 0, which is the
// sum's storage either way), a plan step that names what the run lacks is
// skipped, and a sum out of place that the plan recorded in place (n more bytes
// for the length of one op) has its room made by the heuristic, as any
// kernel's real sizes are: values stay exact and the budget stays hard. The
// cost is a divergence no longer seen between two ops of the same inputs that
// differ only in writing in place or not, which a plan serves alike.

// Note [A step that starts with more]
// A plan is checked against the recorded step, which started with the bytes
// resident at its first op (its constants: weights, gradients, optimizer
// state, what the program kept). A later step can start with much more: an
// optimizer inside the block creates its state in the first step, which is
// then a constant of every later one from its first op. Following the first
// step's plan there spent room the step did not have, and where the step then
// diverged (the optimizer's first step is its own) the evictions the plan had
// made left the online heuristic an impossible state: a loop online DTR runs
// at 60% of its peak ran out of budget in every step after the first. So a
// plan carries start_limit, the most bytes a step may hold at its first op
// and still follow it (the recorded start plus a margin the heuristic makes
// up for: dtr.sim.step_plan's START_MARGIN); a step that starts above it
// diverges at its first op (ordinal 0) and runs online. The core records
// the bytes at the first op of every fingerprinted run (start_memory) for the
// planner and the runtime to compare.

namespace {

inline uint64_t mix(uint64_t h, uint64_t x) {  // (splitmix64's finalizer over h ^ x)
  uint64_t z = h ^ (x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

void Core::set_plan(FollowPlan plan) {
  if (!ops_.empty()) throw std::logic_error("a plan must be set before the first op");
  if (plan.starts.size() != plan.fingerprints.size() + 1 || plan.starts.front() != 0 ||
      plan.starts.back() != int(plan.steps.size()))
    throw std::invalid_argument("a plan needs one start per fingerprint and one more (0 first, steps last)");
  for (size_t k = 1; k < plan.starts.size(); ++k)
    if (plan.starts[k] < plan.starts[k - 1]) throw std::invalid_argument("a plan's starts must not decrease");
  for (const PlanStep& st : plan.steps)
    if ((st.kind != 0 && st.kind != 1) || st.op < 0 || st.index < 0)
      throw std::invalid_argument("a plan step is (0 = evict | 1 = recompute, ordinal >= 0, output >= 0)");
  plan_ = std::move(plan);
  fp_on_ = true;
  following_ = true;
  plan_diverged_ = -1;
}

void Core::record_fingerprints(bool on) {
  if (on && !ops_.empty() && !fp_on_) throw std::logic_error("fingerprints must be recorded from the first op");
  fp_keep_ = on;
  fp_on_ = fp_on_ || on;
}

bool Core::sums_like_a_write(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                             const std::vector<int>& alias_of, const std::vector<int>& inplace_of) const {
  if (inputs.empty() || sizes.size() != 1) return false;
  if ((!inplace_of.empty() && inplace_of[0] >= 0) || (!alias_of.empty() && alias_of[0] >= 0)) return false;
  return sizes[0] == storages_[tensors_.at(inputs[0]).storage].size;
}

uint64_t Core::fingerprint(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                           const std::vector<int>& alias_of, const std::vector<int>& inplace_of) const {
  uint64_t h = mix(0, inputs.size());
  for (int t : inputs) {
    const Tensor& x = tensors_.at(t);
    const int64_t k = ops_[x.op].ordinal;  // (-1: a constant, named by its size)
    h = mix(h, uint64_t(k));
    h = mix(h, k >= 0 ? uint64_t(x.index) : uint64_t(storages_[x.storage].size));
  }
  // (New versions of written inputs are left out: whether a write makes one depends on what is pinned,
  // which depends on the run. Their storages' sizes follow from the inputs, and they come last.)
  if (sums_like_a_write(inputs, sizes, alias_of, inplace_of)) return h;  // (Note [Sums in place or not])
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i < inplace_of.size() && inplace_of[i] >= 0) continue;
    h = mix(h, uint64_t(sizes[i]));
    h = mix(h, uint64_t(int64_t(i < alias_of.size() ? alias_of[i] : -1)));
  }
  return h;
}

uint64_t Core::plan_point(const std::vector<int>& inputs, const std::vector<int64_t>& sizes,
                          const std::vector<int>& alias_of, const std::vector<int>& inplace_of) {
  for (int t : inputs)  // (new_op reports a bad input with its own message)
    if (t < 0 || t >= int(tensors_.size())) return 0;
  const uint64_t fp = fingerprint(inputs, sizes, alias_of, inplace_of);
  const int64_t k = ordinal_;
  if (k == 0) start_memory_ = c_.memory;  // (see Note [A step that starts with more])
  if (!following_) return fp;
  if (k >= int64_t(plan_.fingerprints.size()) || plan_.fingerprints[k] != fp ||
      (k == 0 && plan_.start_limit >= 0 && c_.memory > plan_.start_limit)) {
    following_ = false;
    plan_diverged_ = k;
    return fp;
  }
  follow_steps(k);
  return fp;
}

void Core::follow_steps(int64_t k) {
  for (int i = plan_.starts[k]; i < plan_.starts[k + 1]; ++i) {
    const PlanStep st = plan_.steps[i];
    if (st.op >= int(plan_op_.size()) || plan_op_[st.op] < 0) continue;
    const Op& o = ops_[plan_op_[st.op]];
    if (st.kind == 0) {
      if (st.index >= int(o.outputs.size())) continue;
      const int sid = tensors_[o.outputs[st.index]].storage;
      if (storages_[sid].pool_pos < 0) continue;
      evict(sid, /*by_heuristic=*/false);
      c_.eager_evictions -= 1;  // (evict counted it as a last release's)
      c_.planned_evictions += 1;
      continue;
    }
    const std::vector<int> outs = o.outputs;  // (materialize may move ops_'s elements: no reference kept)
    for (int t : outs) {
      if (tensors_[t].defined) continue;
      if (!recomputable(t)) continue;
      materialize(t, /*remat=*/true);
      c_.planned_remats += 1;
      break;  // (one recomputation of the op defines all its outputs)
    }
  }
}

// Whether t can be recomputed now: it, and every undefined tensor its recomputation needs, is made by an
// op that can still run (not collected) on a storage that is not banished (nor collected). A plan may name an
// op whose output the run no longer needs: what it reads may be gone (a dropped constant that was freed, an
// op collected since). Only such a plan step asks; the walk is over what the recomputation would run.
bool Core::recomputable(int t0) const {
  std::vector<int> stack{t0};
  std::unordered_set<int> seen;  // ops walked (a recomputation's chain can be thousands of ops long)
  while (!stack.empty()) {
    const int t = stack.back();
    stack.pop_back();
    const int op_id = tensors_[t].op;
    if (!seen.insert(op_id).second) continue;
    const Op& op = ops_[op_id];
    const Storage& s = storages_[tensors_[t].storage];
    if (op.collected || s.collected || s.banished) return false;
    for (int p : op.inputs) {
      if (p < 0) return false;
      if (!tensors_[p].defined) stack.push_back(p);
    }
  }
  return true;
}

}  // namespace dtr
