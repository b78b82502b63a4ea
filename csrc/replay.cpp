// replay.cpp - the log replayer: maps the log's handles onto core tensors.
#include "replay.h"

#include <cmath>

namespace dtr {

namespace {

// One handler per instruction kind, indexed by InstrKind.
struct Replayer {
  const Program& prog;
  Core core;
  std::vector<int> tensor_of;  // handle -> core tensor, -1 when dead

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
      for (size_t k = 0; k < i.mutated.size(); ++k) rebind(ins[i.mutated[k]], outs[i.out.size() + k]);
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
    for (size_t k = 0; k < outs.size(); ++k) {
      if (i.inplace) rebind(ins[i.mutated[k]], outs[k]);
      else tensor_of[i.in[i.mutated[k]]] = outs[k];
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
  void run(const Instr& i) {
    using Handler = void (Replayer::*)(const Instr&);
    static constexpr Handler table[] = {&Replayer::constant, &Replayer::call,     &Replayer::mutate,
                                        &Replayer::copy,     &Replayer::copyfrom, &Replayer::release,
                                        &Replayer::pin,      &Replayer::protect,  &Replayer::collect};
    (this->*table[static_cast<int>(i.kind)])(i);
  }
  // simrd's output condition: every tensor still referenced is wanted.
  void outputs() {
    for (int t : tensor_of)
      if (t >= 0) core.pin(t);
  }
};

}  // namespace

ReplayResult replay(const Program& prog, const Config& cfg_in, double thrash_limit, bool check, bool trace) {
  ReplayResult res;
  res.base_total = prog.base_compute();
  Config cfg = cfg_in;
  if (std::isfinite(thrash_limit)) cfg.remat_limit = std::max(0.0, thrash_limit - 1.0) * res.base_total;
  Replayer r(prog, cfg);
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
  if (trace) {
    for (int s = 0; s < r.core.num_storages(); ++s) {
      int root = r.core.storage_root(s);
      res.storage_op.push_back(r.core.op_of(root));
      res.storage_index.push_back(r.core.tensor_index(root));
    }
  }
  return res;
}

}  // namespace dtr
