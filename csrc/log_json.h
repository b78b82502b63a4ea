// log_json.h - the text layer of the log reader: one line of JSON, parsed.
//
// Both log formats are JSON, one small flat object per line (Note [Why the log
// reader is in C++] in logparse.cpp). This header holds what reads such a line:
// UTF-8 checks, quoting a log's strings for error messages, and a minimal JSON
// value and parser (objects, arrays, strings, numbers, literals). Errors are
// std::invalid_argument with the column; logparse.cpp adds the file's line.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtr {
namespace log_json {

// The length of the valid UTF-8 sequence at s[p], or 0 when it is not one.
inline size_t utf8_length(std::string_view s, size_t p) {
  const unsigned char c = s[p];
  size_t n;
  uint32_t cp;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) { n = 2; cp = c & 0x1F; }
  else if (c >= 0xE0 && c <= 0xEF) { n = 3; cp = c & 0x0F; }
  else if (c >= 0xF0 && c <= 0xF4) { n = 4; cp = c & 0x07; }
  else return 0;
  if (p + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    const unsigned char d = s[p + k];
    if ((d & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (d & 0x3F);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return n;
}

// Where a line stops being UTF-8 text (npos when it all is).
inline size_t bad_utf8(std::string_view s) {
  for (size_t p = 0; p < s.size();) {
    if ((unsigned char)s[p] < 0x80) { ++p; continue; }
    size_t n = utf8_length(s, p);
    if (!n) return p;
    p += n;
  }
  return std::string_view::npos;
}

// A log's string (an id, a name) quoted for an error message: one line, short.
inline std::string quote(std::string_view s) {
  std::string out = "'";
  size_t shown = 0;
  for (size_t p = 0; p < s.size(); ++p) {
    if (++shown > 60) { out += "..."; break; }
    const unsigned char c = s[p];
    if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else if (c < 0x80) {
      out += char(c);
    } else {
      size_t n = utf8_length(s, p);
      if (!n) { out += "?"; continue; }
      out.append(s.substr(p, n));
      p += n - 1;
    }
  }
  return out + "'";
}

// A minimal JSON value and parser (objects, arrays, strings, numbers, literals).
struct JValue {
  enum Type { Null, Bool, Num, Str, Arr, Obj } type = Null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<JValue> arr;
  std::vector<std::pair<std::string, JValue>> obj;

  const JValue* get(std::string_view key) const {
    for (const auto& kv : obj)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(std::string_view s) : s_(s) {}

  JValue parse_document() {
    JValue v = value(0);
    ws();
    if (p_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  std::string_view s_;
  size_t p_ = 0;

  [[noreturn]] void fail(const std::string& what) {
    throw std::invalid_argument("invalid JSON at column " + std::to_string(p_ + 1) + ": " + what);
  }
  void ws() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\t' || s_[p_] == '\r' || s_[p_] == '\n')) ++p_;
  }
  char peek() {
    ws();
    if (p_ >= s_.size()) fail("unexpected end of line");
    return s_[p_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++p_;
  }
  JValue value(int depth) {
    if (depth > 64) fail("nesting too deep");
    char c = peek();
    JValue v;
    if (c == '{') {
      v.type = JValue::Obj;
      ++p_;
      if (peek() == '}') { ++p_; return v; }
      for (;;) {
        if (peek() != '"') fail("expected a string key");
        std::string k = string();
        expect(':');
        v.obj.emplace_back(std::move(k), value(depth + 1));
        char d = peek();
        ++p_;
        if (d == '}') break;
        if (d != ',') { --p_; fail("expected ',' or '}'"); }
      }
    } else if (c == '[') {
      v.type = JValue::Arr;
      ++p_;
      if (peek() == ']') { ++p_; return v; }
      for (;;) {
        v.arr.push_back(value(depth + 1));
        char d = peek();
        ++p_;
        if (d == ']') break;
        if (d != ',') { --p_; fail("expected ',' or ']'"); }
      }
    } else if (c == '"') {
      v.type = JValue::Str;
      v.str = string();
    } else if (c == 't' || c == 'f' || c == 'n') {
      auto lit = [&](const char* w) {
        size_t n = std::strlen(w);
        if (s_.substr(p_, n) != w) fail("invalid literal");
        p_ += n;
      };
      if (c == 't') { lit("true"); v.type = JValue::Bool; v.b = true; }
      else if (c == 'f') { lit("false"); v.type = JValue::Bool; }
      else { lit("null"); }
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.type = JValue::Num;
      v.num = number();
    } else {
      fail("unexpected character " + quote(s_.substr(p_, std::max<size_t>(1, utf8_length(s_, p_)))));
    }
    return v;
  }
  // A number as JSON writes it: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  double number() {
    const size_t start = p_;
    auto digits = [&]() {
      size_t k = p_;
      while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9') ++p_;
      return p_ - k;
    };
    auto bad = [&]() {
      while (p_ < s_.size() && (std::isalnum((unsigned char)s_[p_]) || s_[p_] == '.' || s_[p_] == '+' ||
                                s_[p_] == '-'))
        ++p_;
      std::string tok(s_.substr(start, p_ - start));
      p_ = start;
      fail("invalid number " + quote(tok));
    };
    if (s_[p_] == '-') ++p_;
    const size_t int_start = p_;
    const size_t n = digits();
    if (n == 0 || (n > 1 && s_[int_start] == '0')) bad();
    if (p_ < s_.size() && s_[p_] == '.') {
      ++p_;
      if (!digits()) bad();
    }
    if (p_ < s_.size() && (s_[p_] == 'e' || s_[p_] == 'E')) {
      ++p_;
      if (p_ < s_.size() && (s_[p_] == '+' || s_[p_] == '-')) ++p_;
      if (!digits()) bad();
    }
    if (p_ < s_.size() && (std::isalnum((unsigned char)s_[p_]) || s_[p_] == '.')) bad();
    std::string tok(s_.substr(start, p_ - start));
    return std::strtod(tok.c_str(), nullptr);  // +-HUGE_VAL past the double range: rejected by the reader
  }
  unsigned hex4() {
    if (p_ + 4 > s_.size()) fail("bad \\u escape (expected 4 hex digits)");
    unsigned cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[p_ + k];
      int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) fail("bad \\u escape (expected 4 hex digits)");
      cp = cp * 16 + unsigned(d);
    }
    p_ += 4;
    return cp;
  }
  std::string string() {
    ++p_;  // opening quote
    std::string out;
    for (;;) {
      if (p_ >= s_.size()) fail("unterminated string");
      char c = s_[p_++];
      if (c == '"') break;
      if (c == '\\') {
        if (p_ >= s_.size()) fail("unterminated escape");
        char e = s_[p_++];
        switch (e) {
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'n': out += '\n'; break;
          case 'r': out += '\r'; break;
          case 't': out += '\t'; break;
          case 'u': {
            unsigned cp = hex4();
            if (cp >= 0xDC00 && cp <= 0xDFFF) fail("bad \\u escape (a lone low surrogate)");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (s_.substr(p_, 2) != "\\u") fail("bad \\u escape (a high surrogate without its low half)");
              p_ += 2;
              unsigned lo = hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) fail("bad \\u escape (a high surrogate without its low half)");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            if (cp < 0x80) {
              out += char(cp);
            } else if (cp < 0x800) {
              out += char(0xC0 | (cp >> 6));
              out += char(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
              out += char(0xE0 | (cp >> 12));
              out += char(0x80 | ((cp >> 6) & 0x3F));
              out += char(0x80 | (cp & 0x3F));
            } else {
              out += char(0xF0 | (cp >> 18));
              out += char(0x80 | ((cp >> 12) & 0x3F));
              out += char(0x80 | ((cp >> 6) & 0x3F));
              out += char(0x80 | (cp & 0x3F));
            }
            break;
          }
          default: fail("bad escape");
        }
      } else if ((unsigned char)c < 0x20) {
        --p_;
        fail("control character in a string (write it as an escape such as \\n)");
      } else {
        out += c;
      }
    }
    return out;
  }
};

}  // namespace log_json
}  // namespace dtr
