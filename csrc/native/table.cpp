// table.cpp - the storage table (dtr/runtime/storage_table.py: Buf, StorageTable) on the native per-op path,
// and Driver's steps over it (_track, _constant, _carried, _on_evict, _on_pin in dtr/runtime/driver.py). The
// table's maps and Buf records are the reference's own objects, read and written at their slots (Note [The
// storage table] in storage_table.py), so that both paths share one table.
#include "fastpath.h"

#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <exception>

namespace dtr::native {

// --------------------------------------------------------------------- buffers
// The reference's Buf, read and made here (see storage_table.Buf). ``weak`` holds a raw
// weak pointer to the StorageImpl as an int (what UntypedStorage._weak_ref makes).
namespace {

c10::StorageImpl* weak_ptr(PyObject* weak) { return static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(weak)); }

bool weak_expired(PyObject* weak) { return c10::raw::weak_intrusive_ptr::use_count(weak_ptr(weak)) == 0; }

}  // namespace

// Twin of Buf.dead (dtr/runtime/storage_table.py). The reference's ``sys.getrefcount(strong) <= 2`` counts
// the call's own reference: here, no reference but the buffer's (tests/native/test_native.py checks that the two agree).
int buf_dead(PyObject* b) {
  PyObject* strong = slot_at(b, env.buf_strong);
  if (strong != nullptr && strong != Py_None) {
    PyObject* dropped = slot_at(b, env.buf_dropped);
    int d = dropped ? PyObject_IsTrue(dropped) : 0;
    if (d != 0) return d;
    PyObject* shared = slot_at(b, env.buf_shared);
    int sh = shared ? PyObject_IsTrue(shared) : 0;
    if (sh <= 0) return sh;
    if (!THPStorage_Check(strong)) return 0;
    const c10::Storage& st = THPStorage_Unpack(strong);
    return c10::raw::intrusive_ptr::use_count(st.unsafeGetStorageImpl()) <= 1 && Py_REFCNT(strong) <= 1;
  }
  PyObject* weak = slot_at(b, env.buf_weak);
  return weak != nullptr && weak != Py_None && weak_expired(weak);
}

// Whether Buf.get() is None: held weakly and expired.
bool buf_gone(PyObject* b) {
  PyObject* strong = slot_at(b, env.buf_strong);
  if (strong != nullptr && strong != Py_None) return false;
  PyObject* weak = slot_at(b, env.buf_weak);
  return weak == nullptr || weak == Py_None || weak_expired(weak);
}

// Twin of Buf.get (dtr/runtime/storage_table.py), for a buffer that is not dropped: the StorageImpl it
// holds, or null if it is gone.
c10::StorageImpl* buf_get(PyObject* b) {
  PyObject* strong = slot_at(b, env.buf_strong);
  if (strong != nullptr && strong != Py_None)
    return THPStorage_Check(strong) ? THPStorage_Unpack(strong).unsafeGetStorageImpl() : nullptr;
  PyObject* weak = slot_at(b, env.buf_weak);
  return weak == nullptr || weak == Py_None || weak_expired(weak) ? nullptr : weak_ptr(weak);
}

// Buf(storage, owned=False): the program's buffer, held weakly.
PyObject* new_weak_buf(c10::StorageImpl* impl) {
  PyObject* b = env.buf_type->tp_alloc(env.buf_type, 0);
  if (b == nullptr) return nullptr;
  PyObject* weak = PyLong_FromVoidPtr(c10::raw::intrusive_ptr::make_weak(impl));
  if (weak == nullptr) { Py_DECREF(b); return nullptr; }
  slot_at(b, env.buf_weak) = weak;
  Py_INCREF(Py_None); slot_at(b, env.buf_strong) = Py_None;
  Py_INCREF(Py_False); slot_at(b, env.buf_shared) = Py_False;
  Py_INCREF(Py_False); slot_at(b, env.buf_dropped) = Py_False;
  PyObject_GC_UnTrack(b);  // see Note [Untracked records] in py_object.h
  return b;
}

namespace {

// Buf(storage, owned=True, shared=True): a constant's buffer, held strongly (``storage`` is a Python storage).
PyObject* new_shared_buf(PyObject* storage) {
  PyObject* b = env.buf_type->tp_alloc(env.buf_type, 0);
  if (b == nullptr) return nullptr;
  Py_INCREF(Py_None); slot_at(b, env.buf_weak) = Py_None;
  Py_INCREF(storage); slot_at(b, env.buf_strong) = storage;
  Py_INCREF(Py_True); slot_at(b, env.buf_shared) = Py_True;
  Py_INCREF(Py_False); slot_at(b, env.buf_dropped) = Py_False;
  PyObject_GC_UnTrack(b);  // see Note [Untracked records] in py_object.h
  return b;
}

// Buf(torch.UntypedStorage(0, device=device), owned=True): what a version keeps once a write took its buffer.
PyObject* new_empty_owned_buf(const c10::Device& device) {
  c10::Storage empty(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), 0,
                                                           c10::DataPtr(nullptr, device),
                                                           c10::GetAllocator(device.type()), /*resizable=*/true));
  Ref storage(THPStorage_Wrap(std::move(empty)));
  if (!storage) return nullptr;
  PyObject* b = env.buf_type->tp_alloc(env.buf_type, 0);
  if (b == nullptr) return nullptr;
  Py_INCREF(Py_None); slot_at(b, env.buf_weak) = Py_None;
  slot_at(b, env.buf_strong) = storage.release();
  Py_INCREF(Py_False); slot_at(b, env.buf_shared) = Py_False;
  Py_INCREF(Py_False); slot_at(b, env.buf_dropped) = Py_False;
  PyObject_GC_UnTrack(b);  // see Note [Untracked records] in py_object.h
  return b;
}

}  // namespace

// ------------------------------------------------------------------- the table
// Twin of StorageTable.new_handle (dtr/runtime/storage_table.py; driver.py's Note [Handles]).
PyObject* table_new_handle(FastPath* f) {
  PyObject*& slot = slot_at(f->table, table_slots[static_cast<int>(T::_next_handle)]);
  long n = PyLong_AsLong(slot) + 1;
  if (n <= 0) return nullptr;
  PyObject* o = cached_int(n);
  if (o == nullptr) return nullptr;
  Py_INCREF(o);
  Py_SETREF(slot, o);
  return o;
}

// Twin of StorageTable.hold (dtr/runtime/storage_table.py), for the buffer under ``key`` in ``phys``, whose
// ``weak`` is given: replaced by one holding the storage strongly, if it is still there. False with a Python
// exception set on error.
bool table_hold(PyObject* phys, PyObject* key, PyObject* weak) {
  c10::StorageImpl* locked = c10::raw::weak_intrusive_ptr::lock(weak_ptr(weak));
  if (locked == nullptr) return true;  // (gone: Buf.get() is None)
  try {
    Ref st(THPStorage_Wrap(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim(locked))));
    Ref strong(st ? new_shared_buf(st.get()) : nullptr);
    return strong && PyDict_SetItem(phys, key, strong.get()) == 0;
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr native per-op path: %s", e.what());
    return false;
  }
}

// Twin of StorageTable.pinned (dtr/runtime/storage_table.py): core storage ``key`` became a constant; its
// buffer is held strongly, or weakly as a constant's (Note [Constants held weakly] in storage_table.py). False
// with a Python exception set on error.
bool table_pinned(FastPath* f, PyObject* key, bool strongly) {
  PyObject* phys = tget(f, T::phys);
  PyObject* b = phys ? PyDict_GetItemWithError(phys, key) : nullptr;
  if (b == nullptr) return !PyErr_Occurred();
  PyObject* weak = slot_at(b, env.buf_weak);
  if (weak == nullptr || weak == Py_None) return true;
  if (strongly) return table_hold(phys, key, weak);
  if (weak_expired(weak)) return true;  // (gone: Buf.get() is None)
  Ref c(new_weak_buf(weak_ptr(weak)));
  if (!c) return false;
  Py_INCREF(Py_True);
  Py_SETREF(slot_at(c.get(), env.buf_shared), Py_True);
  return PyDict_SetItem(phys, key, c.get()) == 0;
}

// Twin of StorageTable.add (dtr/runtime/storage_table.py): the storage ``impl`` becomes core tensor t (core
// storage s, buffer ``buf``). Its new handle, or null with a Python exception set.
Ref table_add(FastPath* f, long t, int s, c10::StorageImpl* impl, PyObject* buf) {
  Ref cdata(PyLong_FromVoidPtr(impl)), tk(cached_int(t)), sk(cached_int(s));
  if (!cdata || !tk || !sk) return Ref();
  if (PyDict_SetItem(tget(f, T::version), cdata.get(), tk.get()) < 0 ||
      PyDict_SetItem(tget(f, T::cdata_of), tk.get(), cdata.get()) < 0 ||
      PyDict_SetItem(tget(f, T::phys), sk.get(), buf) < 0)
    return Ref();
  Ref h(table_new_handle(f));
  if (!h || PyDict_SetItem(tget(f, T::handle), tk.get(), h.get()) < 0 ||
      PyDict_SetItem(tget(f, T::alive), h.get(), tk.get()) < 0)
    return Ref();
  return h;
}

// Twin of StorageTable.write (dtr/runtime/storage_table.py), but for its count of versions (mode_commit
// keeps that count where it pins long version chains): an in-place write made version ``new_version`` of
// ``old`` (core storages old_storage and new_storage) in the storage ``st`` views. The new version takes the
// buffer; the old one keeps an empty one of its own (recompute.py's Note [Versions]), and the handle moves
// to the new one. The handle, or null with a Python exception set.
Ref table_write(FastPath* f, long old, long new_version, int old_storage, int new_storage, const at::Tensor& st) {
  c10::StorageImpl* impl = st.storage().unsafeGetStorageImpl();
  PyObject* phys = tget(f, T::phys);
  PyObject* version = tget(f, T::version);
  PyObject* cdata_of = tget(f, T::cdata_of);
  PyObject* handle = tget(f, T::handle);
  PyObject* alive = tget(f, T::alive);
  Ref empty(new_empty_owned_buf(st.device())), buf(new_weak_buf(impl));
  Ref old_sk(cached_int(old_storage)), new_sk(cached_int(new_storage)), cdata(PyLong_FromVoidPtr(impl));
  Ref old_k(cached_int(old)), new_k(cached_int(new_version));
  if (!empty || !buf || !old_sk || !new_sk || !cdata || !old_k || !new_k) return Ref();
  if (PyDict_SetItem(phys, old_sk.get(), empty.get()) < 0 || PyDict_SetItem(phys, new_sk.get(), buf.get()) < 0 ||
      PyDict_SetItem(version, cdata.get(), new_k.get()) < 0)
    return Ref();
  if (PyDict_Pop(cdata_of, old_k.get(), nullptr) < 0 || PyDict_SetItem(cdata_of, new_k.get(), cdata.get()) < 0)
    return Ref();
  PyObject* h = PyDict_GetItemWithError(handle, old_k.get());
  if (h == nullptr) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%ld", old);
    return Ref();
  }
  Ref written_handle = borrowed(h);
  if (PyDict_SetItem(handle, new_k.get(), h) < 0) return Ref();
  int in_alive = PyDict_Contains(alive, h);
  if (in_alive < 0 || (in_alive && PyDict_SetItem(alive, h, new_k.get()) < 0)) return Ref();
  return written_handle;
}

// Twin of StorageTable.computed_from (dtr/runtime/storage_table.py): an op computed a new storage or version
// from core tensors ``ins``: the constants among them held weakly are held strongly from now on (Note
// [Constants held weakly] in storage_table.py). False with a Python exception set on error.
bool table_computed_from(FastPath* f, const std::vector<long>& ins) {
  PyObject* phys = tget(f, T::phys);
  for (long t : ins) {
    int s = storage_of(f, t);
    int pinned = s < 0 ? -1 : api->pinned(f->c, s);
    if (pinned < 0) return false;
    if (!pinned) continue;
    Ref key(cached_int(s));
    PyObject* b = key ? PyDict_GetItemWithError(phys, key.get()) : nullptr;
    if (b == nullptr) {
      if (PyErr_Occurred() || !key) return false;
      continue;
    }
    PyObject* shared = slot_at(b, env.buf_shared);
    PyObject* weak = slot_at(b, env.buf_weak);
    if (shared != Py_True || weak == nullptr || weak == Py_None) continue;
    if (!table_hold(phys, key.get(), weak)) return false;
  }
  return true;
}

// Twin of StorageTable.drop (dtr/runtime/storage_table.py): the program dropped the storage of handle h:
// its address is forgotten. Its core tensor, or null with a Python exception set.
Ref table_drop(FastPath* f, PyObject* h) {
  PyObject* alive = tget(f, T::alive);
  Ref t = borrowed(PyDict_GetItemWithError(alive, h));
  if (!t || PyDict_DelItem(alive, h) < 0) return Ref();
  PyObject* cdata_of = tget(f, T::cdata_of);
  Ref cdata = borrowed(PyDict_GetItemWithError(cdata_of, t.get()));
  if (cdata) {
    if (PyDict_DelItem(cdata_of, t.get()) < 0) return Ref();
    PyObject* version = tget(f, T::version);
    PyObject* cur = PyDict_GetItemWithError(version, cdata.get());
    if (cur != nullptr) {
      int eq = PyObject_RichCompareBool(cur, t.get(), Py_EQ);
      if (eq < 0 || (eq && PyDict_DelItem(version, cdata.get()) < 0)) return Ref();
    }
  }
  if (PyErr_Occurred()) return Ref();
  return t;
}

// ------------------------------------------------------ Driver over the table
namespace {

// The version x's storage is now, if dtr tracks it and its buffer is alive: 1 with *version and *storage
// set; 0 if not (first sight, or the address of a storage that died since the last poll); -1 on error.
int live_version(FastPath* f, PyObject* x, long* version, int* storage) {
  const at::Tensor& t = THPVariable_Unpack(x);
  Ref cdata(PyLong_FromVoidPtr(t.storage().unsafeGetStorageImpl()));
  if (!cdata) return -1;
  PyObject* v = PyDict_GetItemWithError(tget(f, T::version), cdata.get());
  if (v == nullptr) return PyErr_Occurred() ? -1 : 0;
  long tv = PyLong_AsLong(v);
  int s = storage_of(f, tv);
  if (s < 0) return -1;
  PyObject* b = phys_of(tget(f, T::phys), s);
  if (b == nullptr) return -1;
  int dead = buf_dead(b);
  if (dead != 0) return dead < 0 ? -1 : 0;
  *version = tv;
  *storage = s;
  return 1;
}

}  // namespace

// Twin of Driver._track (dtr/runtime/driver.py): the current version of x's storage; a constant on first sight.
long mode_track(FastPath* f, PyObject* x) {
  long tv;
  int s;
  int live = live_version(f, x, &tv, &s);
  if (live < 0) return -1;
  if (live) return tv;
  // (the address of a storage that died since the last poll, reused; or first sight)
  Ref st(PyObject_CallMethodNoArgs(x, names.untyped_storage));
  if (!st) return -1;
  Ref r(mode_constant(f, st.get()));
  return r ? PyLong_AsLong(r.get()) : -1;
}

// For an in-place op on x: the version x's storage is now, if the op can be this path's write (reference.py's
// _commit: a tracked storage, alive): 1 for a new version (not pinned), 2 for a write to a weakly held
// constant that protect() would pin nothing for (its protection does nothing: Note [Constants held weakly]
// in storage_table.py); 0 if the reference must take it (another constant, or first sight); -1 on error.
// Reads state only: mode_track(x) then returns the same version.
int written_version(FastPath* f, PyObject* x, long* out) {
  long tv;
  int st;
  int live = live_version(f, x, &tv, &st);
  if (live <= 0) return live;
  int pinned = api->pinned(f->c, st);
  if (pinned < 0) return -1;
  if (pinned) {  // only a weakly held constant's (its protect targets are few: a strong one's walk the graph)
    Ref key(cached_int(st));
    PyObject* b = key ? PyDict_GetItemWithError(tget(f, T::phys), key.get()) : nullptr;
    if (b == nullptr) return PyErr_Occurred() || !key ? -1 : 0;
    PyObject* weak = slot_at(b, env.buf_weak);
    if (slot_at(b, env.buf_shared) != Py_True || weak == nullptr || weak == Py_None) return 0;
    int n = api->protect_targets(f->c, st, nullptr, 0);
    if (n != 0) return n < 0 ? -1 : 0;
  }
  *out = tv;
  return pinned ? 2 : 1;
}

// Twin of Driver._constant (dtr/runtime/driver.py): a storage from before the block (a Python storage)
// becomes a constant. Its core tensor, a new reference.
PyObject* mode_constant(FastPath* f, PyObject* st) {
  if (!THPStorage_Check(st)) {
    PyErr_SetString(PyExc_TypeError, "constant(storage): not a storage");
    return nullptr;
  }
  c10::StorageImpl* impl = THPStorage_Unpack(st).unsafeGetStorageImpl();
  int64_t nbytes = static_cast<int64_t>(impl->nbytes());
  int t = api->constant(f->c, nbytes);
  if (t < 0) { translate_error(); return nullptr; }
  int s = storage_of(f, t);
  if (s < 0) return nullptr;
  Ref tk(cached_int(t));
  Ref buf(new_shared_buf(st));
  if (!tk || !buf) return nullptr;
  Ref h(table_add(f, t, s, impl, buf.get()));
  if (!h) return nullptr;
  PyObject* recorder = mget(f, S::recorder);
  if (recorder != nullptr && recorder != Py_None) {
    Ref n(PyLong_FromLongLong(nbytes));
    if (!n) return nullptr;
    Ref r(PyObject_CallMethodObjArgs(recorder, names.constant, h.get(), n.get(), nullptr));
    if (!r) return nullptr;
  }
  return tk.release();
}

// Twin of Driver._carried (dtr/runtime/driver.py): each resident storage the program still holds, once, in a
// buffer holding it weakly. A new list.
PyObject* mode_carried(FastPath* f) {
  PyObject* alive = tget(f, T::alive);
  PyObject* phys = tget(f, T::phys);
  if (alive == nullptr || phys == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "the mode has no alive/phys tables");
    return nullptr;
  }
  Ref out(PyList_New(0));
  if (!out) return nullptr;
  std::vector<c10::StorageImpl*> seen;  // (sorted: each storage once)
  Py_ssize_t pos = 0;
  PyObject *h, *t;
  while (PyDict_Next(alive, &pos, &h, &t)) {
    int s = storage_of(f, PyLong_AsLong(t));
    if (s < 0) return nullptr;
    Ref key(cached_int(s));
    if (!key) return nullptr;
    PyObject* b = PyDict_GetItemWithError(phys, key.get());
    if (b == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      continue;
    }
    PyObject* dropped = slot_at(b, env.buf_dropped);
    int d = dropped ? PyObject_IsTrue(dropped) : 0;
    if (d < 0) return nullptr;
    c10::StorageImpl* impl = d ? nullptr : buf_get(b);
    if (impl == nullptr || impl->nbytes() == 0) continue;
    auto at = std::lower_bound(seen.begin(), seen.end(), impl);
    if (at != seen.end() && *at == impl) continue;
    seen.insert(at, impl);
    Ref w(new_weak_buf(impl));
    if (!w || PyList_Append(out.get(), w.get()) < 0) return nullptr;
  }
  return out.release();
}

// Twin of Driver._on_evict (dtr/runtime/driver.py) where it has work: the core's on_evict hook while this path
// runs (a C function: Note [The core's C route] in core_api.h). Driver._on_evict has nothing to do for a
// storage that nothing references and whose buffer is gone (the program dropped it and the core freed it) or
// holds no bytes (an old version's, once a write took its buffer: collection frees those), so those cases end
// here; any other goes to the reference. 0, or -1 with a Python exception set.
int mode_on_evict(FastPath* f, int s) {
  Ref key(cached_int(s));
  if (!key) return -1;
  PyObject* b = PyDict_GetItemWithError(tget(f, T::phys), key.get());
  if (b == nullptr && PyErr_Occurred()) return -1;
  c10::StorageImpl* impl = b == nullptr ? nullptr : buf_get(b);
  if (impl == nullptr || impl->nbytes() == 0) {  // (resizing it to 0 bytes would change nothing)
    int64_t refs = api->storage_refs(f->c, s);
    if (refs < 0) return -1;
    if (refs == 0) return 0;
  }
  Ref r(PyObject_CallMethodOneArg(f->mode, names._on_evict, key.get()));
  return r ? 0 : -1;
}

// Twin of Driver._on_pin (dtr/runtime/driver.py): the core's on_pin hook (core storage ``s``, an int) while
// this path runs. A constant must outlive the program's references once something computed from it may need
// its value: its buffer is then held strongly, else weakly as a constant's (table_pinned). False with a
// Python exception set on error.
bool mode_on_pin(FastPath* f, PyObject* s) {
  long sv = PyLong_AsLong(s);
  int deps = api->dependents(f->c, static_cast<int>(sv));
  int64_t size = deps < 0 ? -1 : api->storage_size(f->c, static_cast<int>(sv));
  if (size < 0) return false;
  return table_pinned(f, s, deps > 0 || size == 0);  // (StorageTable.pinned's ``strongly``, as _on_pin decides it)
}

}  // namespace dtr::native
