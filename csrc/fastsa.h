// fastsa.h - the inner loop of the FastSA planner (dtr/sim/planners/fastsa.py; fastsa.txt section 2).
//
// Torch-free and independent of the eviction core: a slot vector of units, the life intervals of their
// values in an add-max segment tree, and the add / remove / rotate mutations under simulated annealing.
// The Python planner owns everything else (node grouping, the start sequence, the schedule, checking it).
#pragma once

#include <cstdint>
#include <vector>

namespace dtr {

// Flags of an annealing problem's units and values.
enum FastsaFlag : uint8_t {
  kFastsaFixed = 1,   // unit: never added or removed (a constant: computed once, where it is)
  kFastsaPinned = 2,  // value: lives from its production to the end (a constant's)
  kFastsaKeep = 4,    // value: its last production lives to the end (referenced at the end)
};

// An annealing problem: units (a node, or a group of nodes) that read and produce values (storages).
// A value is produced by one unit; its producer's slots are its productions.
struct FastsaProblem {
  std::vector<int> in_ptr;         // CSR: unit u reads the values in_idx[in_ptr[u]:in_ptr[u+1]]
  std::vector<int> in_idx;
  std::vector<int> out_ptr;        // CSR: unit u produces the values out_idx[out_ptr[u]:out_ptr[u+1]]
  std::vector<int> out_idx;
  std::vector<int64_t> extra;      // bytes unit u needs on top while it runs (a group's intermediates)
  std::vector<double> cost;        // cost of one computation of u
  std::vector<uint8_t> unit_flags; // kFastsaFixed
  std::vector<int64_t> size;       // bytes of value v
  std::vector<uint8_t> value_flags;  // kFastsaPinned, kFastsaKeep
};

// The knobs of one annealing run.
struct FastsaParams {
  int64_t budget = 0;
  int64_t iterations = 0;          // at most this many mutation attempts
  double temp0 = 1e-3;             // start temperature (times temp_scale)
  double temp1 = 1e-7;             // end temperature (times temp_scale), geometric in between
  double temp_scale = 0;           // <= 0: the start objective
  uint64_t seed = 0;
  double time_limit = 0;           // seconds (<= 0: none)
  bool stop_when_feasible = false; // stop as soon as the peak is within the budget (the paper's first stage)
  bool soft_peak = false;          // the objective's peak is appendix C.2's log-sum-exp over the slots
  bool keep_order = false;         // units' first computations stay in unit order (a program's order)
};

// What an annealing run returns.
struct FastsaResult {
  std::vector<int> slots;  // the best state seen (-1: nop): within the budget and cheapest, else the lowest objective
  int64_t iterations = 0;  // mutation attempts made
  int64_t accepted = 0;    // mutations accepted
  int64_t peak = 0;        // the best state's peak (the model's)
  double cost = 0;         // its cost
  bool feasible = false;   // its peak is within the budget
  double objective0 = 0;   // the start objective max(budget, peak) * cost
  double temp_end = 0;     // the absolute temperature reached
  int64_t peak0 = 0;       // the start peak
};

// Anneal `slots` (unit per time slot, -1 for nop; a valid start: every read after a production) under
// the objective max(budget, peak) * cost. Throws std::invalid_argument on an inconsistent problem.
FastsaResult fastsa_anneal(const FastsaProblem& p, std::vector<int> slots, const FastsaParams& par);

}  // namespace dtr
