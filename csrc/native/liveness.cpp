// liveness.cpp - which storages the program still holds (dtr/runtime/liveness.py: Liveness) on the native
// per-op path: the polls before an op, the releases they make, and the handles an op leaves for the next
// ops' polls. What a poll cannot settle alone goes to the reference (Driver.poll).
#include "fastpath.h"

#include <algorithm>

namespace dtr::native {

// Twin of Liveness.due (dtr/runtime/liveness.py): whether the scheduled full poll is due before an op that
// brings the core's memory to ``need`` bytes.
bool liveness_due(FastPath* f, long ops_seen, int64_t need) {
  if (ops_seen < PyLong_AsLong(lget(f, L::next_full_poll))) return false;
  PyObject* on_schedule = lget(f, L::on_schedule);
  if (on_schedule == Py_True) return true;
  return need > api->peak_memory(f->c);
}

// Twin of Liveness.saw (dtr/runtime/liveness.py): an op read or wrote ``handles`` (a list): the next ops'
// partial polls look at them. False with a Python exception set on error.
bool liveness_saw(FastPath* f, Ref handles) {
  PyObject* recent = lget(f, L::recent);
  if (!PyList_CheckExact(recent)) {
    PyErr_SetString(PyExc_TypeError, "dtr internal error: the liveness's recent is not a list; please report this");
    return false;
  }
  Py_ssize_t n = PyList_GET_SIZE(recent);
  if (n > 0 && n == env.recent_ops) {  // full: drop the oldest and append, in place (the reference's append, del [0])
    PyObject** items = reinterpret_cast<PyListObject*>(recent)->ob_item;
    PyObject* oldest = items[0];
    for (Py_ssize_t i = 1; i < n; ++i) items[i - 1] = items[i];
    items[n - 1] = handles.release();
    Py_DECREF(oldest);
  } else if (PyList_Append(recent, handles.get()) < 0 ||
             (PyList_GET_SIZE(recent) > env.recent_ops && PySequence_DelItem(recent, 0) < 0)) {
    return false;
  }
  return true;
}

// Twin of Liveness.release (dtr/runtime/liveness.py): the program dropped the storage of handle h (an
// activation): it is released in the table, the log and the core. False with a Python exception set on error.
bool liveness_release(FastPath* f, PyObject* h) {
  Ref t = table_drop(f, h);
  if (!t) return false;
  PyObject* recorder = mget(f, S::recorder);
  if (recorder != nullptr && recorder != Py_None) {
    Ref r(PyObject_CallMethodOneArg(recorder, names.release, h));
    if (!r) return false;
  }
  long tv = PyLong_AsLong(t.get());
  if (api->release(f->c, static_cast<int>(tv)) < 0) { translate_error(); return false; }
  int s = storage_of(f, tv);
  if (s < 0) return false;
  int res = api->resident(f->c, s);
  if (res < 0) return false;
  if (res) {
    int64_t refs = api->storage_refs(f->c, s);
    if (refs < 0) return false;
    if (refs == 0) {  // kept for an evicted dependent
      Ref key(cached_int(s));
      PyObject* b = PyDict_GetItemWithError(tget(f, T::phys), key.get());
      if (b == nullptr && PyErr_Occurred()) return false;
      if (b == nullptr || buf_gone(b)) {  // but its memory is gone: it must be recomputed
        if (api->forget(f->c, s) < 0) return false;
      }
    }
  }
  return true;
}

// Twin of Liveness.worth_keeping (dtr/runtime/liveness.py): whether dead constant s costs less kept than
// protecting what needs it (Note [Keeping a dead constant] in liveness.py): 0/1, with ``targets`` set to what
// protect(s) would pin; -1 on error.
int liveness_worth_keeping(FastPath* f, int s, std::vector<int>& targets) {
  int n = api->protect_targets(f->c, s, nullptr, 0);
  if (n < 0) return -1;
  targets.resize(static_cast<size_t>(n));
  if (n > 0 && api->protect_targets(f->c, s, targets.data(), n) != n) return -1;
  int64_t own = api->storage_size(f->c, s), sum = 0;
  if (own < 0) return -1;
  for (int d : targets) {
    int64_t z = api->storage_size(f->c, d);
    if (z < 0) return -1;
    sum += z;
  }
  return own < sum ? 1 : 0;
}

namespace {

// Whether the handle's storage is dead (its buffer says so); -1 on error. Sets *constant if it is dead and a
// constant (pinned).
int handle_dead(FastPath* f, PyObject* alive, PyObject* phys, PyObject* h, bool* constant) {
  PyObject* t = PyDict_GetItemWithError(alive, h);
  if (t == nullptr) return PyErr_Occurred() ? -1 : 0;
  int s = storage_of(f, PyLong_AsLong(t));
  if (s < 0) return -1;
  PyObject* b = phys_of(phys, s);
  if (b == nullptr) return -1;
  int d = buf_dead(b);
  if (d <= 0) return d;
  int p = api->pinned(f->c, s);
  if (p < 0) return -1;
  *constant = *constant || p;
  return 1;
}

// What Liveness.poll(ops, handles) does with the dead handles ``dead`` of a partial poll when some are
// constants, if it can be done here: 1 done, 0 for the reference to do, -1 on error. Here means that no
// constant's protection would first release a dropped target or recompute (Note [Protecting in a partial
// poll] in liveness.py): for each dead constant, what protect() would pin is resident and alive, or the
// constant is worth keeping (Note [Keeping a dead constant] in liveness.py). Then, as the reference: the
// activations are released, and each constant not worth keeping (asked again: the releases can change it) is
// protected (and recorded so), then released. Pinned gradients end so: dropped by autograd or by the
// program's zero_grad(set_to_none=True) once their version chains were pinned.
int settle_constants(FastPath* f, PyObject* alive, PyObject* phys, const std::vector<PyObject*>& dead) {
  std::vector<int> targets;
  auto storage_of_handle = [&](PyObject* h) -> int {  // -2: not alive
    PyObject* t = PyDict_GetItemWithError(alive, h);
    if (t == nullptr) return PyErr_Occurred() ? -1 : -2;
    return storage_of(f, PyLong_AsLong(t));
  };
  std::vector<PyObject*> constants, activations;
  for (PyObject* h : dead) {
    int s = storage_of_handle(h);
    if (s < 0) return s == -2 ? 0 : -1;
    int p = api->pinned(f->c, s);
    if (p < 0) return -1;
    (p ? constants : activations).push_back(h);
    if (!p) continue;
    int w = liveness_worth_keeping(f, s, targets);
    if (w < 0) return -1;
    if (w) continue;
    for (int d : targets) {  // the reference would release a dropped target first, or recompute: its case
      int r = api->resident(f->c, d);
      if (r < 0) return -1;
      Ref key(cached_int(d));
      PyObject* b = key ? PyDict_GetItemWithError(phys, key.get()) : nullptr;
      if (b == nullptr && PyErr_Occurred()) return -1;
      int gone = b == nullptr ? 1 : buf_dead(b);
      if (gone < 0) return -1;
      if (!r || gone) return 0;
    }
  }
  for (PyObject* h : activations)
    if (!liveness_release(f, h)) return -1;
  std::vector<PyObject*> protect;
  for (PyObject* h : constants) {
    int s = storage_of_handle(h);
    if (s == -2) continue;
    if (s < 0) return -1;
    int w = liveness_worth_keeping(f, s, targets);
    if (w < 0) return -1;
    if (!w) protect.push_back(h);
  }
  PyObject* recorder = mget(f, S::recorder);
  for (PyObject* h : protect) {
    if (recorder != nullptr && recorder != Py_None) {
      Ref r(PyObject_CallMethodOneArg(recorder, names.protect, h));
      if (!r) return -1;
    }
    int s = storage_of_handle(h);
    if (s < 0) return -1;
    if (api->protect(f->c, s) < 0) { translate_error(); return -1; }
  }
  for (PyObject* h : protect)
    if (!liveness_release(f, h)) return -1;
  return 1;
}

}  // namespace

// Twin of Liveness.poll (dtr/runtime/liveness.py) with handles: the partial poll over the last ops' handles
// (the lists in ``recent``); what it cannot settle alone goes to the reference.
bool liveness_poll_recent(FastPath* f, PyObject* recent, Scratch& scratch) {
  // Each handle once, in order (the reference's dict.fromkeys). Equal handles are one object: each is made
  // once (StorageTable.new_handle) and only ever copied (driver.py's Note [Handles]).
  std::vector<PyObject*>& handles = scratch.handles;
  Py_ssize_t n = PyList_GET_SIZE(recent);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* hs = PyList_GET_ITEM(recent, i);
    Py_ssize_t m = PyList_GET_SIZE(hs);
    for (Py_ssize_t j = 0; j < m; ++j) {
      PyObject* h = PyList_GET_ITEM(hs, j);
      if (std::find(handles.begin(), handles.end(), h) == handles.end()) handles.push_back(h);
    }
  }
  PyObject* alive = tget(f, T::alive);
  PyObject* phys = tget(f, T::phys);
  std::vector<PyObject*>& dead = scratch.dead;
  bool constant = false;
  for (PyObject* h : handles) {
    int d = handle_dead(f, alive, phys, h, &constant);
    if (d < 0) return false;
    if (d) dead.push_back(h);
  }
  if (dead.empty()) return true;
  std::vector<Ref> keep_dead;  // (releasing deletes the handles from alive)
  for (PyObject* d : dead) keep_dead.push_back(borrowed(d));
  int settled = constant ? settle_constants(f, alive, phys, dead) : 0;
  if (settled < 0) return false;
  if (settled) return true;
  if (constant) {  // a dropped constant the reference decides on (Note [Keeping a dead constant])
    Ref list(PyList_New(static_cast<Py_ssize_t>(handles.size())));
    if (!list) return false;
    for (size_t i = 0; i < handles.size(); ++i) {
      Py_INCREF(handles[i]);
      PyList_SET_ITEM(list.get(), i, handles[i]);
    }
    Ref r(PyObject_CallMethodOneArg(f->mode, names.poll, list.get()));
    return static_cast<bool>(r);
  }
  for (PyObject* d : dead)
    if (!liveness_release(f, d)) return false;
  return true;
}

// Twin of Liveness.poll (dtr/runtime/liveness.py) without handles: the scheduled full poll, over every live
// handle. As in liveness_poll_recent, dead activations are released here; a dead constant sends the whole poll
// to the reference (it protects, keeps or releases).
bool liveness_poll_full(FastPath* f, Scratch& scratch) {
  Ref r(PyObject_CallMethodOneArg(f->liveness, names.schedule, mget(f, S::ops_seen)));
  if (!r) return false;
  PyObject* alive = tget(f, T::alive);
  PyObject* phys = tget(f, T::phys);
  std::vector<PyObject*>& dead = scratch.dead;  // borrowed from alive until the releases start
  Py_ssize_t pos = 0;
  PyObject *h, *t;
  bool constant = false;
  while (PyDict_Next(alive, &pos, &h, &t)) {
    int s = storage_of(f, PyLong_AsLong(t));
    if (s < 0) return false;
    PyObject* b = phys_of(phys, s);
    if (b == nullptr) return false;
    int d = buf_dead(b);
    if (d < 0) return false;
    if (!d) continue;
    int p = api->pinned(f->c, s);
    if (p < 0) return false;
    if (p) { constant = true; break; }
    dead.push_back(h);
  }
  if (constant) {
    Ref r2(PyObject_CallMethodNoArgs(f->mode, names.poll));
    return static_cast<bool>(r2);
  }
  std::vector<Ref> keep;  // releasing deletes the handles from alive
  keep.reserve(dead.size());
  for (PyObject* d : dead) keep.push_back(borrowed(d));
  for (PyObject* d : dead)
    if (!liveness_release(f, d)) return false;
  return true;
}

}  // namespace dtr::native
