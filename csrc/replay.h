// replay.h - drive the core with a parsed log (the simulator's inner loop).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core.h"
#include "program.h"

namespace dtr {

// How a replay ended (dtr._C.ReplayStatus in Python, a str enum of these names).
enum class ReplayStatus : uint8_t {
  Ok = 0,      // "ok": every instruction ran and the outputs are resident
  Oom = 1,     // "oom": no eviction could make room
  Thrash = 2,  // "thrash": rematerialization passed the thrash limit
};
constexpr ReplayStatus kReplayStatuses[] = {ReplayStatus::Ok, ReplayStatus::Oom, ReplayStatus::Thrash};

// The status as the replay's result and its JSON spell it (the one place that does).
inline const char* status_name(ReplayStatus s) {
  switch (s) {
    case ReplayStatus::Ok: return "ok";
    case ReplayStatus::Oom: return "oom";
    case ReplayStatus::Thrash: return "thrash";
  }
  return "?";
}

// One event of a replay's trace, `(kind, id)` in Python (dtr._C.TraceEvent).
enum class TraceEvent : uint8_t {
  Computed = 0,    // op computed for the first time (id = core op)
  Recomputed = 1,  // op recomputed (id = core op)
  Evicted = 2,     // storage evicted by the heuristic (id = core storage)
  Freed = 3,       // storage freed otherwise (id = core storage): see ReplayResult::trace
};

struct ReplayResult {
  ReplayStatus status = ReplayStatus::Ok;
  Counters counters;
  double base_total = 0;      // the log's own compute (sum of CALL and MUTATE costs)
  int64_t needed_bytes = 0;   // for "oom": memory that had to be resident when it failed
  int failed_line = 0;        // for "oom" / "thrash": the log line being replayed
  int64_t instructions = 0;   // instructions replayed
  // With tracing: the run as events, in order. Computed: an op computed for
  // the first time, Recomputed: an op recomputed (id = core op), Evicted: a
  // storage evicted by the heuristic, Freed: a storage freed otherwise: its
  // last reference died, it was collected, or it is a banished output of the
  // op just recomputed, which the core frees at once (id = core storage). An
  // op without outputs is reported once (Computed). op_instr[k] is the
  // instruction index that created core op k; storage_op[s] /
  // storage_index[s] the op and output position that allocate s.
  std::vector<std::pair<TraceEvent, int>> trace;
  std::vector<int> op_instr, storage_op, storage_index;
  // With fingerprints: each op's (Note [Following a plan] in core_follow.cpp). With a plan: the ops that
  // matched it, and the ordinal of the first that did not (-1: none).
  std::vector<uint64_t> fingerprints;
  int64_t start_memory = -1;  // with fingerprints: the bytes resident at the first op (Core::start_memory)
  int64_t plan_followed = 0, plan_diverged_at = -1;
};

// Replays `prog` on a fresh Core. The run stops ("thrash") once recomputation
// passes what cfg.thrash_limit allows over the whole log (its compute and its
// ops, unless cfg.thrash_base / thrash_base_ops say otherwise: Note [The thrash
// limit] in dtr/semantics.py). Live handles at the end are outputs:
// rematerialized if needed and pinned. With `check`, Core::check() runs after
// every instruction (tests). With a plan, the core follows it (Note [Following a plan] in core_follow.cpp);
// with `fingerprints`, the result has each op's.
ReplayResult replay(const Program& prog, const Config& cfg, bool check, bool trace = false,
                    const FollowPlan* plan = nullptr, bool fingerprints = false);

// The core's tables after replaying a whole program without a budget: the
// exact operator graph of dtr.sim.graph (see Note [The exact graph is the
// core's] in replay.cpp). Indexed by the core's own ids: op k, tensor t,
// storage s. Nothing is compacted, so every op, tensor and storage the replay
// created is there, collected ones included.
struct ReplayGraph {
  // Per op: the instruction that created it (index into Program::instrs)
  // with that instruction's kind, log line and name (-1: none); its cost,
  // input and output tensors, the storages it allocates (its outputs that
  // are not views, in order) and their bytes, and the storages it writes in
  // place (the old versions of its new-version outputs, one per version).
  std::vector<int> op_instr, op_kind, op_line, op_name;
  std::vector<double> op_cost;
  std::vector<std::vector<int>> op_inputs, op_outputs, op_fresh, op_overwrites;
  std::vector<int64_t> op_alloc;
  // Per tensor: its op, its storage, whether it is a view (an alias).
  std::vector<int> tensor_op, tensor_storage;
  std::vector<char> tensor_alias;
  // Per storage: bytes, the op that allocates it, its tensors (in order).
  std::vector<int64_t> storage_size;
  std::vector<int> storage_op;
  std::vector<std::vector<int>> storage_tensors;
  // The tensors some handle still refers to when the program ends (ascending).
  std::vector<int> referenced_at_end;
};

// Replays `prog` on a fresh Core configured as `cfg` except that it has no
// budget, no rematerialization limit and does not banish, and reads the
// graph off the core. The output condition is not applied (it pins, which
// creates no id).
ReplayGraph replay_graph(const Program& prog, const Config& cfg);

}  // namespace dtr
