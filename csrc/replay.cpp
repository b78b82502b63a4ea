// replay.cpp - the log replayer: maps the log's handles onto core tensors.
#include "replay.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace dtr {

namespace {

// One handler per instruction kind, indexed by InstrKind.
struct Replayer {
  const Program& prog;
  Core core;
  std::vector<int> tensor_of;  // handle -> core tensor, -1 when dead
  // After an in-place write (a call with `mutated`, an in-place mutate): the
  // storages it overwrote, one per new version (a pinned one gets none).
  std::vector<int> wrote;

  Replayer(const Program& p, const Config& cfg) : prog(p), core(cfg), tensor_of(p.handle_names.size(), -1) {}

  std::vector<int> tensors(const std::vector<int>& handles) const {
    std::vector<int> out;
    out.reserve(handles.size());
    for (int h : handles) out.push_back(tensor_of[h]);
    return out;
  }
  void constant(const Instr& i) { tensor_of[i.out[0]] = core.constant(i.sizes[0]); }
  void call(const Instr& i) {
    if (i.inplace) {
      const std::vector<int> ins = tensors(i.in);
      std::vector<int> outs = core.call_inplace(ins, i.sizes, i.aliases, i.mutated, i.cost);
      for (size_t k = 0; k < i.out.size(); ++k) tensor_of[i.out[k]] = outs[k];
      wrote.clear();
      for (size_t k = 0; k < i.mutated.size(); ++k) {
        const int fresh = outs[i.out.size() + k];
        if (fresh >= 0) wrote.push_back(core.storage_of(ins[i.mutated[k]]));
        rebind(ins[i.mutated[k]], fresh);
      }
      return;
    }
    std::vector<int> outs = core.call(tensors(i.in), i.sizes, i.aliases, i.cost);
    for (size_t k = 0; k < outs.size(); ++k) tensor_of[i.out[k]] = outs[k];
  }
  void rebind(int old, int fresh) {  // every handle of the old version moves to the new one
    if (fresh < 0) return;          // a constant written in place keeps its tensor
    for (int& t : tensor_of)
      if (t == old) t = fresh;
  }
  void mutate(const Instr& i) {
    const std::vector<int> ins = tensors(i.in);
    std::vector<int> outs = i.inplace ? core.mutate_inplace(ins, i.mutated, i.cost)
                                      : core.mutate(ins, i.mutated, i.cost);
    if (i.inplace) wrote.clear();
    for (size_t k = 0; k < outs.size(); ++k) {
      if (!i.inplace) {
        tensor_of[i.in[i.mutated[k]]] = outs[k];
        continue;
      }
      if (outs[k] >= 0) wrote.push_back(core.storage_of(ins[i.mutated[k]]));
      rebind(ins[i.mutated[k]], outs[k]);
    }
  }
  void copy(const Instr& i) {
    int t = tensor_of[i.in[0]];
    core.retain(t);
    tensor_of[i.out[0]] = t;
  }
  void copyfrom(const Instr& i) {
    int t = tensor_of[i.in[0]], old = tensor_of[i.out[0]];
    core.retain(t);  // before the release, so that `dst = dst` keeps the tensor
    core.release(old);
    tensor_of[i.out[0]] = t;
  }
  void release(const Instr& i) {
    core.release(tensor_of[i.in[0]]);
    tensor_of[i.in[0]] = -1;
  }
  void pin(const Instr& i) { core.pin(tensor_of[i.in[0]]); }
  void protect(const Instr& i) { core.protect(core.storage_of(tensor_of[i.in[0]])); }
  void collect(const Instr&) { core.collect(); }  // the runtime's graph GC: it frees storages
  void read(const Instr& i) { core.require(tensor_of[i.in[0]]); }  // (an escape that reads: .tolist(), repr)
  void run(const Instr& i) {
    using Handler = void (Replayer::*)(const Instr&);
    static constexpr Handler table[] = {&Replayer::constant, &Replayer::call,     &Replayer::mutate,
                                        &Replayer::copy,     &Replayer::copyfrom, &Replayer::release,
                                        &Replayer::pin,      &Replayer::protect,  &Replayer::collect,
                                        &Replayer::read};
    (this->*table[static_cast<int>(i.kind)])(i);
  }
  // simrd's output condition: every tensor still referenced is wanted.
  void outputs() {
    std::vector<int> ts;
    for (int t : tensor_of)
      if (t >= 0) ts.push_back(t);
    core.pin_many(ts, Hold::Output);  // (one plan, as the runtime's end of a block: Note [Planned recomputation])
  }
};

}  // namespace

ReplayResult replay(const Program& prog, const Config& cfg_in, bool check, bool trace, const FollowPlan* plan,
                    bool fingerprints) {
  ReplayResult res;
  res.base_total = prog.base_compute();
  Config cfg = cfg_in;  // the thrash limit counts against the whole log (Note [The thrash limit] in dtr/semantics.py)
  if (cfg.thrash_base < 0) cfg.thrash_base = res.base_total;
  if (cfg.thrash_base_ops < 0) cfg.thrash_base_ops = prog.base_ops();
  Replayer r(prog, cfg);
  if (plan != nullptr) r.core.set_plan(*plan);
  if (fingerprints) r.core.record_fingerprints(true);
  if (trace) {
    // A recomputed op's output on a banished (or collected) storage is freed
    // as soon as it is computed (Core::compute): reported right after the op.
    Core& core = r.core;
    r.core.on_compute = [&res, &core](int op, bool remat) {
      // An old version handed over to this recomputation is freed right before it (Note [Handing bytes
      // over on recomputation]); its eviction after the op is then not reported again.
      for (int p : core.op_inputs(op))
        if (core.handed(core.storage_of(p))) res.trace.emplace_back(TraceEvent::Freed, core.storage_of(p));
      res.trace.emplace_back(remat ? TraceEvent::Recomputed : TraceEvent::Computed, op);
      for (int t : core.op_outputs(op)) {
        const int s = core.storage_of(t);
        if (!core.is_alias(t) && core.banished(s)) res.trace.emplace_back(TraceEvent::Freed, s);
      }
    };
    r.core.on_evict = [&res, &core](int s, bool by_heuristic) {
      if (!core.handed(s)) res.trace.emplace_back(by_heuristic ? TraceEvent::Evicted : TraceEvent::Freed, s);
    };
  }
  int line = 0;
  try {
    for (size_t k = 0; k < prog.instrs.size(); ++k) {
      const Instr& i = prog.instrs[k];
      line = i.line;
      const int ops_before = r.core.num_ops();
      r.run(i);
      if (trace)
        for (int op = ops_before; op < r.core.num_ops(); ++op) res.op_instr.push_back(int(k));
      ++res.instructions;
      if (check) r.core.check();
    }
    line = 0;
    r.outputs();
    if (check) r.core.check();
  } catch (const OutOfMemory& e) {
    res.status = ReplayStatus::Oom;
    res.needed_bytes = e.needed;
    res.failed_line = line;
  } catch (const Thrashing&) {
    res.status = ReplayStatus::Thrash;
    res.failed_line = line;
  }
  res.counters = r.core.counters();
  res.fingerprints = r.core.fingerprints();
  res.start_memory = r.core.start_memory();
  res.plan_followed = r.core.plan_followed();
  res.plan_diverged_at = r.core.plan_diverged_at();
  if (trace) {
    for (int s = 0; s < r.core.num_storages(); ++s) {
      int root = r.core.storage_root(s);
      res.storage_op.push_back(r.core.op_of(root));
      res.storage_index.push_back(r.core.tensor_index(root));
    }
  }
  return res;
}

// Note [The exact graph is the core's]
// The static schedules (dtr.sim.schedule) are over the *exact graph*: the
// ops, tensors and storages the core builds when it replays a log, with the
// core's ids, so that the trace of a run (kind 0/1 = compute op, 2/3 = free
// storage) is a schedule over it as it stands. replay_graph() builds that
// graph by replaying the log and reading the core's tables; nothing else
// derives it. Without a budget no storage is evicted by the heuristic, so the
// replay is cheap, and the ids depend only on the instructions and on which
// storages are pinned when an in-place write runs: Core::call_inplace writes
// a pinned storage where it is and gives every other written storage a new
// version. The pinned set follows `pin`, `protect` and, under
// free_dead_constants, the constants dropped by their last release (all of
// which replay_graph() runs under the configuration it is given: the log's
// semantics). `collect` renumbers nothing (the replayer never compacts): the
// collected ops and storages stay in the tables, and the schedule of a run
// frees the collected storages like any other.
//
// A run under a budget builds the same ids, except when its pinned set
// differs. Core::protect's walk stops at a pinned storage only if all its
// tensors are defined (Note [Protecting a constant] in core.cpp). Without a
// budget nothing referenced is evicted, so the pinned storages the walk
// meets are whole; under a budget a storage evicted and brought back through
// its root can be pinned with an undefined view, and protecting a constant
// then also pins what was computed from that storage: an in-place write of
// one of those makes no new version in that run, and every later storage id
// shifts. dtr.sim.export checks each run's ids against the graph and refuses
// such a run (Note [Exporting a DTR run] in dtr/sim/export.py).
ReplayGraph replay_graph(const Program& prog, const Config& cfg_in) {
  Config cfg = cfg_in;
  cfg.budget = -1;
  cfg.thrash_limit = std::numeric_limits<double>::infinity();
  cfg.banish = false;
  Replayer r(prog, cfg);
  ReplayGraph g;
  for (size_t k = 0; k < prog.instrs.size(); ++k) {
    const Instr& i = prog.instrs[k];
    const int ops_before = r.core.num_ops();
    r.wrote.clear();
    r.run(i);
    for (int op = ops_before; op < r.core.num_ops(); ++op) {
      g.op_instr.push_back(int(k));
      g.op_kind.push_back(static_cast<int>(i.kind));
      g.op_line.push_back(i.line);
      g.op_name.push_back(i.name);
      // An instruction makes at most one op: an in-place write's is its last.
      g.op_overwrites.push_back(op + 1 == r.core.num_ops() ? r.wrote : std::vector<int>());
    }
  }
  const Core& core = r.core;
  const int nops = core.num_ops(), nts = core.num_tensors(), nss = core.num_storages();
  g.op_cost.reserve(nops);
  g.op_inputs.reserve(nops);
  g.op_outputs.reserve(nops);
  g.op_fresh.reserve(nops);
  g.op_alloc.reserve(nops);
  for (int op = 0; op < nops; ++op) {
    g.op_cost.push_back(core.op_cost(op));
    g.op_inputs.push_back(core.op_inputs(op));
    g.op_outputs.push_back(core.op_outputs(op));
    std::vector<int> fresh;
    int64_t alloc = 0;
    for (int t : core.op_outputs(op)) {
      if (core.is_alias(t)) continue;
      fresh.push_back(core.storage_of(t));
      alloc += core.storage_size(core.storage_of(t));
    }
    g.op_fresh.push_back(std::move(fresh));
    g.op_alloc.push_back(alloc);
  }
  g.tensor_op.reserve(nts);
  g.tensor_storage.reserve(nts);
  g.tensor_alias.reserve(nts);
  for (int t = 0; t < nts; ++t) {
    g.tensor_op.push_back(core.op_of(t));
    g.tensor_storage.push_back(core.storage_of(t));
    g.tensor_alias.push_back(core.is_alias(t));
  }
  g.storage_size.reserve(nss);
  g.storage_op.reserve(nss);
  g.storage_tensors.reserve(nss);
  for (int s = 0; s < nss; ++s) {
    g.storage_size.push_back(core.storage_size(s));
    g.storage_op.push_back(core.op_of(core.storage_root(s)));
    g.storage_tensors.push_back(core.storage_tensors(s));
  }
  for (int t : r.tensor_of)
    if (t >= 0) g.referenced_at_end.push_back(t);
  std::sort(g.referenced_at_end.begin(), g.referenced_at_end.end());
  g.referenced_at_end.erase(std::unique(g.referenced_at_end.begin(), g.referenced_at_end.end()),
                            g.referenced_at_end.end());
  return g;
}

}  // namespace dtr
