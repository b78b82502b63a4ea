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
};

// Replays `prog` on a fresh Core. A finite `thrash_limit` X stops the run once
// rematerialization pushes total compute past X times the log's compute. Live
// handles at the end are outputs: rematerialized if needed and pinned. With
// `check`, Core::check() runs after every instruction (tests).
ReplayResult replay(const Program& prog, const Config& cfg, double thrash_limit, bool check, bool trace = false);

}  // namespace dtr
