// core_internal.h - small helpers shared by the core's source files (core_*.cpp).
// Not part of the core's interface (that is core.h).
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "core.h"

namespace dtr {

constexpr double kInf = std::numeric_limits<double>::infinity();

template <class T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Two small functions that the subsystems call in their inner loops: defined
// here, so that each file can inline them.

// The root of union-find node n, compressing the path (core_eqclass.cpp).
inline int Core::uf_find(int n) {
  int r = n;
  while (uf_[r].parent != r) {
    r = uf_[r].parent;
    c_.storage_accesses += 1;
  }
  while (uf_[n].parent != r) {
    int next = uf_[n].parent;
    uf_[n].parent = r;
    n = next;
  }
  return r;
}

// Queue S's leaf in the bound tree for a refresh before the next choice (Note
// [Choosing without scanning] in core_evict.cpp).
inline void Core::bt_touch(int sid) {
  if (!bt_on_) return;
  Storage& s = storages_[sid];
  if (s.bt_slot < 0 || s.bt_dirty) return;
  s.bt_dirty = true;
  bt_dirty_.push_back(sid);
}

}  // namespace dtr
