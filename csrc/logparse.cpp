// logparse.cpp - readers for the v1 (JSON Lines, "op") and simrd ("INSTRUCTION") logs.
//
// Note [Why the log reader is in C++]
// Replaying a 50k-line log is dominated by reading it: Python's json.loads alone
// costs about as much as the whole simulation. The reader below parses the small,
// flat JSON objects of both formats directly into a Program, validating ids as it
// goes, so `dtr-sim replay` spends its time simulating. Each format is a table
// from instruction name to handler; adding an instruction is one table entry.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "log_json.h"
#include "program.h"

namespace dtr {
namespace {

using log_json::bad_utf8;
using log_json::JsonParser;
using log_json::JValue;
using log_json::quote;

// ---------------------------------------------------------------------------
// Bounds.

// Note [Bounds on what a log may ask for]
// The core keeps memory in int64 counters and compute in doubles. Rather than
// checking every sum inside the core, the reader bounds what a log can make it
// add up: every size is at most kMaxSize (below 2^53, so that the double that
// carries a JSON number holds it exactly), every byte total the core can reach
// (the bytes of every storage the log can ever allocate, and one operator's
// inputs and outputs together) at most kMaxTotalBytes = 2^61, so that the
// core's sums of a few such totals stay below 2^63, and the costs together at
// most kMaxTotalCost, leaving room for many recomputations in a double. A log
// past a bound is an error naming the line where it was passed.
constexpr int64_t kMaxSize = int64_t(1) << 52;
constexpr int64_t kMaxTotalBytes = int64_t(1) << 61;
constexpr double kMaxTotalCost = 1e250;

// ---------------------------------------------------------------------------
// Shared reader state: handle interning and liveness, error helpers.
class Reader {
 public:
  explicit Reader(Program& prog) : prog_(prog) {}
  int line = 0;

  [[noreturn]] void error(const std::string& msg) const { throw LogError(line, msg); }

  const JValue& field(const JValue& o, const char* key) const {
    const JValue* v = o.get(key);
    if (!v) error(std::string("missing field '") + key + "'");
    return *v;
  }
  std::string str_field(const JValue& o, const char* key) const {
    const JValue& v = field(o, key);
    if (v.type != JValue::Str) error(std::string("field '") + key + "' must be a string");
    return v.str;
  }
  // A number, or (simrd only) a number written as a string: simrd's logs write
  // TIME and MEMORY as strings; a v1 log writes JSON numbers, and a string there
  // is a field of the wrong type (docs/log-format.md, Checks).
  bool strings_as_numbers = false;
  double num_field(const JValue& o, const char* key) const { return as_num(field(o, key), key); }
  double as_num(const JValue& v, const char* key) const {
    if (v.type == JValue::Num) return v.num;
    if (!strings_as_numbers)
      error(std::string("field '") + key + "' must be a number" +
            (v.type == JValue::Str ? " (write it without quotes)" : ""));
    if (v.type == JValue::Str && !v.str.empty() &&
        v.str.find_first_not_of("0123456789.eE+-") == std::string::npos) {  // no hex, inf, nan or spaces
      char* end = nullptr;
      double d = std::strtod(v.str.c_str(), &end);
      if (end == v.str.c_str() + v.str.size()) return d;
    }
    error(std::string("field '") + key + "' must be a number");
  }
  std::vector<std::string> str_list(const JValue& o, const char* key) const {
    const JValue& v = field(o, key);
    if (v.type != JValue::Arr) error(std::string("field '") + key + "' must be a list of ids");
    std::vector<std::string> out;
    for (const auto& e : v.arr) {
      if (e.type != JValue::Str) error(std::string("field '") + key + "' must be a list of ids (strings)");
      out.push_back(e.str);
    }
    return out;
  }
  int64_t size_value(double d, const char* key) const {
    if (std::isnan(d) || d < 0) error(std::string("negative or invalid size in '") + key + "'");
    if (d > double(kMaxSize))
      error(std::string("size in '") + key + "' is too large: at most " + std::to_string(kMaxSize) +
            " bytes (2^52) per tensor");
    if (d != std::floor(d)) error(std::string("size in '") + key + "' must be a whole number of bytes");
    return int64_t(d);
  }
  double cost_value(double d, const char* key) {
    if (!std::isfinite(d) || d < 0) error(std::string("negative or invalid cost in '") + key + "'");
    total_cost_ += d;
    if (!(total_cost_ <= kMaxTotalCost))
      error(std::string("the costs add up to more than 1e250 (at '") + key + "'); rescale the log's costs");
    return d;
  }
  // Note [Bounds on what a log may ask for]: `bytes` more may be allocated.
  void allocate(int64_t bytes) {
    add_bytes(allocated_, bytes, "the log allocates more than 2^61 bytes in all (every tensor it creates, "
                                 "counted once)");
  }
  void add_bytes(int64_t& total, int64_t bytes, const char* what) const {
    if (__builtin_add_overflow(total, bytes, &total) || total > kMaxTotalBytes) error(what);
  }
  // Bytes of the storage handle h refers to (sizes of views count their base's).
  int64_t storage_bytes(int h) const { return h < int(bytes_.size()) ? bytes_[h] : 0; }
  void set_bytes(int h, int64_t b) {
    if (h >= int(bytes_.size())) bytes_.resize(h + 1, 0);
    bytes_[h] = b;
  }
  // One operator's inputs and outputs together stay within the bound too.
  void check_working_set(const Instr& ins) const {
    int64_t w = 0;
    const char* what = "one operator's inputs and outputs add up to more than 2^61 bytes";
    for (int h : ins.in) add_bytes(w, storage_bytes(h), what);
    for (int64_t b : ins.sizes) add_bytes(w, b, what);
    for (int j : ins.mutated) add_bytes(w, storage_bytes(ins.in[j]), what);
  }

  // A handle that must be live (read).
  int use(const std::string& id) const {
    auto it = ids_.find(id);
    if (it == ids_.end() || !live_[it->second]) error("unknown id " + quote(id) + " (never defined, or already released)");
    return it->second;
  }
  bool is_live(const std::string& id) const {
    auto it = ids_.find(id);
    return it != ids_.end() && live_[it->second];
  }
  // A handle that must be new (defined here).
  int define(const std::string& id) {
    auto it = ids_.find(id);
    if (it != ids_.end()) {
      if (live_[it->second]) error("id " + quote(id) + " is defined twice");
      live_[it->second] = true;
      return it->second;
    }
    int h = int(prog_.handle_names.size());
    prog_.handle_names.push_back(id);
    live_.push_back(true);
    ids_.emplace(id, h);
    return h;
  }
  void kill(int h) { live_[h] = false; }
  // Input `idx` of `ins` is written in place (`field` names the log's list of them). Each write makes a new
  // version of the input and releases the old one, so one tensor written twice by an op would be released
  // twice (the core refuses that): the same id listed twice, or at two argument indices (simrd's MUTATE).
  void add_mutated(Instr& ins, int idx, const char* field) const {
    for (int j : ins.mutated)
      if (ins.in[j] == ins.in[idx])
        error(std::string("field '") + field + "' lists input " + quote(prog_.handle_names[ins.in[idx]]) +
              " twice (an op writes each input once)");
    ins.mutated.push_back(idx);
  }
  int op_name(const std::string& n) {
    auto it = names_.find(n);
    if (it != names_.end()) return it->second;
    int k = int(prog_.names.size());
    prog_.names.push_back(n);
    names_.emplace(n, k);
    return k;
  }
  void emit(Instr&& ins) {
    if (ins.kind == InstrKind::Constant || ins.kind == InstrKind::Call || ins.kind == InstrKind::Mutate) {
      check_working_set(ins);
      int64_t fresh = 0;
      for (size_t k = 0; k < ins.sizes.size(); ++k)
        if (ins.aliases.empty() || ins.aliases[k] < 0) fresh += ins.sizes[k];  // each <= 2^52, at most 2^61 in all
      for (int j : ins.mutated) fresh += storage_bytes(ins.in[j]);
      allocate(fresh);
      for (size_t k = 0; k < ins.out.size() && k < ins.sizes.size(); ++k)
        set_bytes(ins.out[k], !ins.aliases.empty() && ins.aliases[k] >= 0 ? storage_bytes(ins.in[ins.aliases[k]])
                                                                          : ins.sizes[k]);
    }
    ins.line = pending_line_ ? pending_line_ : line;
    prog_.instrs.push_back(std::move(ins));
  }
  // copy / copyfrom (src -> dst) and release (src only): the same in both formats.
  void handle_op(InstrKind kind, const JValue& o, const char* src_key, const char* dst_key) {
    Instr ins{kind};
    const int src = use(str_field(o, src_key));
    ins.in.push_back(src);
    if (kind == InstrKind::Copy) ins.out.push_back(define(str_field(o, dst_key)));
    if (kind == InstrKind::CopyFrom) ins.out.push_back(use(str_field(o, dst_key)));
    if (kind != InstrKind::Release) set_bytes(ins.out[0], storage_bytes(src));
    if (kind == InstrKind::Release) kill(src);
    emit(std::move(ins));
  }
  Program& prog() { return prog_; }
  int pending_line_ = 0;

 private:
  Program& prog_;
  std::unordered_map<std::string, int> ids_;
  std::vector<bool> live_;
  std::unordered_map<std::string, int> names_;
  std::vector<int64_t> bytes_;  // handle -> bytes of its storage
  int64_t allocated_ = 0;       // bytes of every storage the log can allocate
  double total_cost_ = 0;
};

// ---------------------------------------------------------------------------
// Format v1: one self-contained JSON object per line, keyed by "op".
class V1Reader {
 public:
  explicit V1Reader(Reader& r) : r_(r) {}

  void line(const JValue& o) {
    if (o.type != JValue::Obj) r_.error("each line must be a JSON object");
    std::string op = r_.str_field(o, "op");
    static const std::unordered_map<std::string, void (V1Reader::*)(const JValue&)> table = {
        {"meta", &V1Reader::meta},         {"constant", &V1Reader::constant}, {"call", &V1Reader::call},
        {"mutate", &V1Reader::mutate},     {"copy", &V1Reader::copy},         {"copyfrom", &V1Reader::copyfrom},
        {"release", &V1Reader::release},   {"pin", &V1Reader::pin},
        {"protect", &V1Reader::protect},   {"collect", &V1Reader::collect},
        {"read", &V1Reader::read},
    };
    auto it = table.find(op);
    if (it == table.end())
      r_.error("unknown op " + quote(op) + " (valid: meta, constant, call, mutate, copy, copyfrom, release, pin, protect, collect, read)");
    (this->*(it->second))(o);
    if (!first_line_) first_line_ = r_.line;
  }

 private:
  Reader& r_;
  int first_line_ = 0;  // the line of the log's first instruction (0: none read yet)
  int meta_line_ = 0;   // the meta line's line (0: none)

  void meta(const JValue& o) {
    // Only the first line's meta is read (parse_log keeps it in meta_json); a
    // later one, even a second meta line, would be ignored, so it is refused.
    if (meta_line_)
      r_.error("a second 'meta' line (the first is line " + std::to_string(meta_line_) +
               "): a log has at most one, as its first line");
    if (first_line_)
      r_.error("the 'meta' line must be the log's first line (line " + std::to_string(first_line_) +
               " comes before it): move it to the top");
    meta_line_ = r_.line;
    if (const JValue* v = o.get("version")) {
      if (v->type != JValue::Num || v->num != 1) r_.error("unsupported log version (this reader knows version 1)");
    }
    if (const JValue* u = o.get("cost_unit")) {
      if (u->type != JValue::Str || u->str.empty() || u->str.size() > 32 || quote(u->str) != "'" + u->str + "'")
        r_.error("field 'cost_unit' must be a short string without control characters (ns, flop, ...)");
      r_.prog().cost_unit = u->str;
    }
  }
  void constant(const JValue& o) {
    Instr ins{InstrKind::Constant};
    ins.sizes.push_back(r_.size_value(r_.num_field(o, "size"), "size"));
    ins.out.push_back(r_.define(r_.str_field(o, "id")));
    r_.emit(std::move(ins));
  }
  void call(const JValue& o) {
    Instr ins{InstrKind::Call};
    ins.name = r_.op_name(r_.str_field(o, "name"));
    ins.cost = r_.cost_value(r_.num_field(o, "cost"), "cost");
    auto inputs = r_.str_list(o, "inputs");
    auto outputs = r_.str_list(o, "outputs");
    const JValue& sizes = r_.field(o, "sizes");
    const JValue& aliases = r_.field(o, "aliases");
    if (sizes.type != JValue::Arr || sizes.arr.size() != outputs.size())
      r_.error("'sizes' must be a list with one size per output");
    if (aliases.type != JValue::Arr || aliases.arr.size() != outputs.size())
      r_.error("'aliases' must be a list with one entry (null or an input id) per output");
    for (const auto& i : inputs) ins.in.push_back(r_.use(i));
    for (size_t k = 0; k < outputs.size(); ++k) {
      if (sizes.arr[k].type != JValue::Num) r_.error("'sizes' must be a list of numbers (bytes), without quotes");
      ins.sizes.push_back(r_.size_value(sizes.arr[k].num, "sizes"));
      const JValue& a = aliases.arr[k];
      if (a.type == JValue::Null) {
        ins.aliases.push_back(-1);
      } else if (a.type == JValue::Str) {
        int idx = -1;
        for (size_t j = 0; j < inputs.size(); ++j)
          if (inputs[j] == a.str) { idx = int(j); break; }
        if (idx < 0) r_.error("output " + quote(outputs[k]) + " aliases " + quote(a.str) + ", which is not an input of this call");
        ins.aliases.push_back(idx);
      } else {
        r_.error("'aliases' entries must be null or an input id");
      }
    }
    if (const JValue* m = o.get("mutated")) {  // an extension: also writes these inputs in place
      if (m->type != JValue::Arr) r_.error("field 'mutated' must be a list of input ids");
      for (const auto& e : m->arr) {
        int idx = -1;
        for (size_t j = 0; j < inputs.size() && e.type == JValue::Str; ++j)
          if (inputs[j] == e.str) { idx = int(j); break; }
        if (idx < 0) r_.error("mutated entries must be ids of inputs of this call");
        r_.add_mutated(ins, idx, "mutated");
      }
      ins.inplace = true;
    }
    for (const auto& out : outputs) ins.out.push_back(r_.define(out));
    r_.emit(std::move(ins));
  }
  void mutate(const JValue& o) {
    Instr ins{InstrKind::Mutate};
    ins.name = r_.op_name(r_.str_field(o, "name"));
    ins.cost = r_.cost_value(r_.num_field(o, "cost"), "cost");
    auto inputs = r_.str_list(o, "inputs");
    for (const auto& i : inputs) ins.in.push_back(r_.use(i));
    for (const auto& m : r_.str_list(o, "mutated")) {
      int idx = -1;
      for (size_t j = 0; j < inputs.size(); ++j)
        if (inputs[j] == m) { idx = int(j); break; }
      if (idx < 0) r_.error("mutated id " + quote(m) + " is not an input of this mutate");
      r_.add_mutated(ins, idx, "mutated");
    }
    if (const JValue* ip = o.get("inplace")) {
      if (ip->type != JValue::Bool) r_.error("field 'inplace' must be true or false");
      ins.inplace = ip->b;
    }
    r_.emit(std::move(ins));
  }
  void copy(const JValue& o) { r_.handle_op(InstrKind::Copy, o, "src", "dst"); }
  void pin(const JValue& o) { one_id(InstrKind::Pin, o); }
  void protect(const JValue& o) { one_id(InstrKind::Protect, o); }
  void collect(const JValue&) { r_.emit(Instr{InstrKind::Collect}); }
  void read(const JValue& o) { one_id(InstrKind::Read, o); }
  void one_id(InstrKind kind, const JValue& o) {
    Instr ins{kind};
    ins.in.push_back(r_.use(r_.str_field(o, "id")));
    r_.emit(std::move(ins));
  }
  void copyfrom(const JValue& o) { r_.handle_op(InstrKind::CopyFrom, o, "src", "dst"); }
  void release(const JValue& o) { r_.handle_op(InstrKind::Release, o, "id", nullptr); }
};

// ---------------------------------------------------------------------------
// The original simrd format: "INSTRUCTION"-keyed lines; CALL and CONSTANT are
// followed by MEMORY (and, for CALL, ALIAS) lines for each output. Only what
// follows ANNOTATE START is the step (the whole file when there is no START).
class SimrdReader {
 public:
  explicit SimrdReader(Reader& r, bool has_start) : r_(r), active_(!has_start) {}

  void line(const JValue& o) {
    if (o.type != JValue::Obj) r_.error("each line must be a JSON object");
    std::string ins = r_.str_field(o, "INSTRUCTION");
    static const std::unordered_map<std::string, void (SimrdReader::*)(const JValue&)> table = {
        {"ANNOTATE", &SimrdReader::annotate}, {"CONSTANT", &SimrdReader::constant},
        {"MEMORY", &SimrdReader::memory},     {"ALIAS", &SimrdReader::alias},
        {"CALL", &SimrdReader::call},         {"MUTATE", &SimrdReader::mutate},
        {"COPY", &SimrdReader::copy},         {"COPY_FROM", &SimrdReader::copyfrom},
        {"RELEASE", &SimrdReader::release},
    };
    auto it = table.find(ins);
    if (it == table.end())
      r_.error("unknown INSTRUCTION " + quote(ins) + " (valid: ANNOTATE, CONSTANT, MEMORY, CALL, ALIAS, MUTATE, COPY, COPY_FROM, RELEASE)");
    if (!active_ && ins != "ANNOTATE") return;
    if (pending_ && ins != "MEMORY" && ins != "ALIAS") incomplete();
    (this->*(it->second))(o);
  }

  void finish() {
    if (pending_) incomplete();
  }

 private:
  Reader& r_;
  bool active_;
  // The CALL / CONSTANT being assembled from its MEMORY / ALIAS lines.
  std::unique_ptr<Instr> pending_;
  std::vector<std::string> pending_outs_;
  std::vector<bool> got_mem_, got_alias_;
  int pending_line_ = 0;

  [[noreturn]] void incomplete() {
    size_t k = 0;
    while (k < pending_outs_.size() && got_mem_[k] && got_alias_[k]) ++k;
    r_.line = pending_line_;
    r_.error(std::string(pending_->kind == InstrKind::Call ? "CALL" : "CONSTANT") +
             " is not followed by the MEMORY" + (pending_->kind == InstrKind::Call ? " and ALIAS" : "") +
             " lines of its output " + quote(pending_outs_[k]));
  }
  void start(Instr&& ins, std::vector<std::string> outs) {
    pending_ = std::make_unique<Instr>(std::move(ins));
    pending_outs_ = std::move(outs);
    got_mem_.assign(pending_outs_.size(), false);
    got_alias_.assign(pending_outs_.size(), pending_->kind == InstrKind::Constant);
    pending_->sizes.assign(pending_outs_.size(), 0);
    if (pending_->kind == InstrKind::Call) pending_->aliases.assign(pending_outs_.size(), -1);
    pending_line_ = r_.line;
    maybe_complete();
  }
  int pending_index(const std::string& name, const char* what) {
    if (!pending_) r_.error(std::string(what) + " for " + quote(name) + " does not follow a CALL or CONSTANT");
    for (size_t k = 0; k < pending_outs_.size(); ++k)
      if (pending_outs_[k] == name) return int(k);
    r_.error(std::string(what) + " names " + quote(name) + ", which is not an output of the preceding instruction");
  }
  void maybe_complete() {
    for (size_t k = 0; k < pending_outs_.size(); ++k)
      if (!got_mem_[k] || !got_alias_[k]) return;
    int saved = r_.line;
    r_.line = pending_line_;
    for (const auto& out : pending_outs_) pending_->out.push_back(r_.define(out));
    r_.line = saved;
    r_.pending_line_ = pending_line_;
    r_.emit(std::move(*pending_));
    r_.pending_line_ = 0;
    pending_.reset();
  }

  void annotate(const JValue& o) {
    std::string a = r_.str_field(o, "ANNOTATION");
    if (a == "START") active_ = true;
  }
  void constant(const JValue& o) {
    Instr ins{InstrKind::Constant};
    start(std::move(ins), {r_.str_field(o, "NAME")});
  }
  void memory(const JValue& o) {
    std::string n = r_.str_field(o, "NAME");
    int k = pending_index(n, "MEMORY");
    if (got_mem_[k]) r_.error("second MEMORY line for " + quote(n));
    pending_->sizes[k] = r_.size_value(r_.num_field(o, "MEMORY"), "MEMORY");
    got_mem_[k] = true;
    maybe_complete();
  }
  void alias(const JValue& o) {
    std::string n = r_.str_field(o, "NAME");
    int k = pending_index(n, "ALIAS");
    if (pending_->kind != InstrKind::Call) r_.error("ALIAS for " + quote(n) + " follows a CONSTANT");
    if (got_alias_[k]) r_.error("second ALIAS line for " + quote(n));
    double a = r_.num_field(o, "ALIAS");
    if (a != std::floor(a) || a < -1 || a >= double(pending_->in.size()))
      r_.error("ALIAS of " + quote(n) + " must be -1 or the index of an argument (0.." +
               std::to_string(int(pending_->in.size()) - 1) + ")");
    pending_->aliases[k] = int(a);
    got_alias_[k] = true;
    maybe_complete();
  }
  void call(const JValue& o) {
    Instr ins{InstrKind::Call};
    ins.name = r_.op_name(r_.str_field(o, "NAME"));
    ins.cost = r_.cost_value(r_.num_field(o, "TIME"), "TIME");
    for (const auto& a : r_.str_list(o, "ARGS")) ins.in.push_back(r_.use(a));
    auto outs = r_.str_list(o, "RESULT");
    for (const auto& out : outs)
      if (r_.is_live(out)) r_.error("id " + quote(out) + " is defined twice");
    start(std::move(ins), std::move(outs));
  }
  void mutate(const JValue& o) {
    Instr ins{InstrKind::Mutate};
    ins.name = r_.op_name(r_.str_field(o, "NAME"));
    ins.cost = r_.cost_value(r_.num_field(o, "TIME"), "TIME");
    for (const auto& a : r_.str_list(o, "ARGS")) ins.in.push_back(r_.use(a));
    const JValue& m = r_.field(o, "MUTATE");
    if (m.type != JValue::Arr) r_.error("field 'MUTATE' must be a list of argument indices");
    for (const auto& e : m.arr) {
      double d = r_.as_num(e, "MUTATE");
      if (d != std::floor(d) || d < 0 || d >= double(ins.in.size()))
        r_.error("MUTATE index " + std::to_string(d) + " is not an argument index (0.." +
                 std::to_string(int(ins.in.size()) - 1) + ")");
      r_.add_mutated(ins, int(d), "MUTATE");
    }
    r_.emit(std::move(ins));
  }
  void copy(const JValue& o) { r_.handle_op(InstrKind::Copy, o, "SRC", "DST"); }
  void copyfrom(const JValue& o) { r_.handle_op(InstrKind::CopyFrom, o, "SRC", "DST"); }
  void release(const JValue& o) { r_.handle_op(InstrKind::Release, o, "NAME", nullptr); }
};

bool blank(std::string_view s) {
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\r') return false;
  return true;
}

}  // namespace

Program parse_log(const std::string& text) {
  Program prog;
  Reader reader(prog);
  std::string_view all(text);
  // A UTF-8 byte order mark (some Windows editors write one) is not part of the log.
  if (all.substr(0, 3) == "\xEF\xBB\xBF") all.remove_prefix(3);

  // Split into lines once; detect the format from the first non-blank line.
  std::vector<std::string_view> lines;
  size_t pos = 0;
  while (pos < all.size()) {
    size_t nl = all.find('\n', pos);
    if (nl == std::string_view::npos) nl = all.size();
    lines.push_back(all.substr(pos, nl - pos));
    pos = nl + 1;
  }
  auto parse_line = [&](size_t k) -> JValue {
    reader.line = int(k + 1);
    const size_t bad = bad_utf8(lines[k]);
    if (bad != std::string_view::npos) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "not UTF-8 text (byte 0x%02X at column %zu): a binary file, or a corrupt log?",
                    (unsigned char)lines[k][bad], bad + 1);
      reader.error(buf);
    }
    try {
      return JsonParser(lines[k]).parse_document();
    } catch (const std::invalid_argument& e) {
      reader.error(e.what());
    }
  };

  size_t first = 0;
  while (first < lines.size() && blank(lines[first])) ++first;
  if (first == lines.size()) throw LogError(0, "the log is empty");
  JValue head = parse_line(first);
  if (head.type == JValue::Obj && head.get("INSTRUCTION")) {
    prog.format = "simrd";
  } else if (head.type == JValue::Obj && head.get("op")) {
    prog.format = "v1";
    if (const JValue* op = head.get("op"); op->type == JValue::Str && op->str == "meta")
    {
      prog.meta_json = std::string(lines[first]);
      prog.meta_line = int(first + 1);
    }
  } else {
    reader.error("not a dtr log: expected a JSON object with \"op\" (format v1) or \"INSTRUCTION\" (simrd format)");
  }

  if (prog.format == "v1") {
    V1Reader v1(reader);
    for (size_t k = first; k < lines.size(); ++k) {
      if (blank(lines[k])) continue;
      v1.line(k == first ? head : parse_line(k));
    }
  } else {
    bool has_start = text.find("\"START\"") != std::string::npos;
    reader.strings_as_numbers = true;
    SimrdReader sr(reader, has_start);
    for (size_t k = first; k < lines.size(); ++k) {
      if (blank(lines[k])) continue;
      sr.line(k == first ? head : parse_line(k));
    }
    sr.finish();
  }
  return prog;
}

}  // namespace dtr
