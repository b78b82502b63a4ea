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
  int64_t max_live_tensors = 0;
};

// Replays `prog` on a fresh Core. A finite `thrash_limit` X stops the run once
// rematerialization pushes total compute past X times the log's compute. Live
// handles at the end are outputs: rematerialized if needed and pinned. With
// `check`, Core::check() runs after every instruction (tests).
ReplayResult replay(const Program& prog, const Config& cfg, double thrash_limit, bool check);

}  // namespace dtr
