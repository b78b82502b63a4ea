// program.h - the parsed form of an operator log, shared by both log formats.
//
// A Program is a flat list of instructions over *handles*: small integers that
// stand for the log's string ids (interned in order of first appearance). The
// log reader validates every instruction as it reads it, so a Program is always
// consistent: every handle an instruction reads is live at that point.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtr {

// An instruction's kind: the int `kind` of Program.records() (dtr._C.InstrKind
// in Python, where a Record's kind is its name in lower case).
enum class InstrKind : uint8_t {
  Constant = 0,  // out[0] = new pinned tensor of sizes[0] bytes
  Call = 1,      // out = name(in); sizes[i], aliases[i] (index into in, or -1)
  Mutate = 2,    // name(in) writes in[j] for j in mutated (indices into in)
  Copy = 3,      // out[0] = new handle to in[0]'s tensor
  CopyFrom = 4,  // existing handle out[0] now refers to in[0]'s tensor
  Release = 5,   // handle in[0] dies
  Pin = 6,       // handle in[0]'s tensor becomes a constant (brought back if needed, never evicted)
  Protect = 7,   // handle in[0] (a constant) is about to go: pin what still needs its value
  Collect = 8,   // graph GC (Core::collect): storages nothing can need again are freed
  Read = 9,      // handle in[0]'s bytes are read outside the dispatcher: brought back if needed, not pinned
};

struct Instr {
  InstrKind kind;
  int line = 0;             // 1-based line in the source file (first line of a multi-line simrd op)
  int name = -1;            // index into Program::names (operator name), -1 when none
  double cost = 0.0;
  std::vector<int> in;      // handles read
  std::vector<int> out;     // handles written
  std::vector<int64_t> sizes;
  std::vector<int> aliases;   // Call: per output, index into `in` it views, or -1
  std::vector<int> mutated;   // Mutate: indices into `in`
  bool inplace = false;       // Mutate: a true in-place write (Core::mutate_inplace), not simrd's copy
};

struct Program {
  std::string format;                 // "v1" or "simrd"
  std::string cost_unit = "ns";
  std::string meta_json;              // the v1 meta line, verbatim ("" when absent)
  int meta_line = 0;                  // its 1-based line number (0 when absent)
  std::vector<Instr> instrs;
  std::vector<std::string> handle_names;  // handle -> the log's id
  std::vector<std::string> names;         // interned operator names

  double base_compute() const {
    double c = 0;
    for (const auto& i : instrs)
      if (i.kind == InstrKind::Call || i.kind == InstrKind::Mutate) c += i.cost;
    return c;
  }
  // The ops the log computes (calls and mutations): the base of the thrash limit's count.
  int64_t base_ops() const {
    int64_t n = 0;
    for (const auto& i : instrs) n += i.kind == InstrKind::Call || i.kind == InstrKind::Mutate;
    return n;
  }
};

// A malformed or inconsistent log line.
struct LogError : std::runtime_error {
  int line;
  LogError(int line_, const std::string& msg) : std::runtime_error(msg), line(line_) {}
};

// Parse a whole log held in memory (already decompressed). Detects the format
// from the first instruction line. Throws LogError on the first bad line.
Program parse_log(const std::string& text);

}  // namespace dtr
