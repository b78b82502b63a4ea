// depth_pool.h - scratch objects reused across calls, one per nesting depth and thread.
//
// Note [Scratch by nesting depth]
// A function that runs for every op (the native per-op path, the core's
// materialize, begin_call through the core's C table) needs a few vectors
// for the length of one call. Made fresh, each costs a heap allocation and a
// free per op; kept in a static, their capacity stays. But such a call may
// run again before it returns (a hook runs the driver's code, which may
// dispatch another op), so one static object is not enough: a call leases
// the object of its nesting depth, and a nested call gets the next one. The
// objects are per thread (autograd's backward runs ops on its own thread)
// and never freed (a few per thread). Torch-free, header-only: the core and
// dtr._native each instantiate it for their own types.
#pragma once

#include <cstddef>
#include <vector>

namespace dtr {

// Holds the calling depth's T for as long as it lives; T is default-constructed once per depth and thread,
// and keeps whatever the last holder left in it (a holder clears what it needs cleared).
template <class T>
class DepthLease {
 public:
  DepthLease() {
    if (depth_ == pool_.size()) pool_.push_back(new T());  // (never freed)
    t_ = pool_[depth_++];
  }
  ~DepthLease() { --depth_; }
  DepthLease(const DepthLease&) = delete;
  DepthLease& operator=(const DepthLease&) = delete;
  T& operator*() const { return *t_; }

 private:
  T* t_;
  static thread_local std::vector<T*> pool_;
  static thread_local size_t depth_;
};

template <class T>
thread_local std::vector<T*> DepthLease<T>::pool_;
template <class T>
thread_local size_t DepthLease<T>::depth_ = 0;

}  // namespace dtr
