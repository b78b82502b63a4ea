// replay.h - drive the core with a parsed log (the simulator's inner loop).
#pragma once

#include <limits>
#include <string>

#include "core.h"
#include "program.h"

namespace dtr {

struct ReplayResult {
  std::string status = "ok";  // "ok", "oom" or "thrash"
  Counters counters;
  double base_total = 0;      // the log's own compute (sum of CALL and MUTATE costs)
  int64_t needed_bytes = 0;   // for "oom": memory that had to be resident when it failed
  int failed_line = 0;        // for "oom" / "thrash": the log line being replayed
  int64_t instructions = 0;   // instructions replayed
  // With tracing: the run as events, in order. kind 0 = op computed for the
  // first time, 1 = op recomputed (id = core op), 2 = storage evicted by the
  // heuristic, 3 = storage freed otherwise: its last reference died, it was
  // collected, or it is a banished output of the op just recomputed, which
  // the core frees at once (id = core storage). An op without outputs is
  // reported once (kind 0). op_instr[k] is the instruction index that created
  // core op k; storage_op[s] / storage_index[s] the op and output position
  // that allocate s.
  std::vector<std::pair<int, int>> trace;
  std::vector<int> op_instr, storage_op, storage_index;
};

// Replays `prog` on a fresh Core. A finite `thrash_limit` X stops the run once
// rematerialization pushes total compute past X times the log's compute. Live
// handles at the end are outputs: rematerialized if needed and pinned. With
// `check`, Core::check() runs after every instruction (tests).
ReplayResult replay(const Program& prog, const Config& cfg, double thrash_limit, bool check, bool trace = false);

}  // namespace dtr
