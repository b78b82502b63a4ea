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

}  // namespace dtr
