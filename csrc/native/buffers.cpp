// buffers.cpp - a buffer's bytes freed, allocated, viewed, copied and swapped on the StorageImpl itself, with no
// Python storage object made for the program's storage (Note [Buffers without Python storages] in
// dtr/runtime/storage_table.py). The twins of what Buf does the Python way (Buf.fill, Buf.view, Buf.swap); the
// native path's Driver and Recomputer call these (their ``buffers`` is this module).
#include "fastpath.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Storage.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <exception>
#include <vector>

namespace dtr::native {
namespace {

// The StorageImpl of a Buf (null if it is gone) or of a tensor; null with a Python exception set if ``o`` is
// neither (then *err is set).
c10::StorageImpl* impl_of(PyObject* o, bool* err) {
  *err = false;
  if (env.ready && PyObject_TypeCheck(o, env.buf_type)) return buf_get(o);
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.has_storage()) return t.storage().unsafeGetStorageImpl();
  }
  *err = true;
  PyErr_SetString(PyExc_TypeError, "dtr._native: expected a Buf (after configure()) or a tensor with a storage");
  return nullptr;
}

c10::StorageImpl* live_impl(PyObject* o) {
  bool err;
  c10::StorageImpl* impl = impl_of(o, &err);
  if (impl == nullptr && !err)
    PyErr_SetString(PyExc_RuntimeError,
                    "dtr internal error: the buffer of a storage dtr needs is gone; please report this");
  return impl;
}

// A strong reference to a live StorageImpl (the caller holds the GIL; the buffer checked it is alive).
c10::Storage storage_at(c10::StorageImpl* impl) {
  return c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(impl));
}

// UntypedStorage.resize_ (resize_bytes_cpu, resize_bytes_cuda) on any device: n bytes from the storage's own
// allocator, on its device, with the first min(old, n) bytes kept.
void resize_impl(c10::StorageImpl* impl, int64_t n) {
  if (n == static_cast<int64_t>(impl->nbytes())) return;
  c10::Device device = impl->device();
  if (n == 0) {
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, device));
    impl->set_nbytes(0);
    return;
  }
  TORCH_CHECK(impl->allocator() != nullptr, "Trying to resize storage without an allocator");
  c10::OptionalDeviceGuard guard(device);
  int64_t keep = std::min<int64_t>(n, static_cast<int64_t>(impl->nbytes()));
  if (keep == 0) {  // (dtr's case: an evicted storage refilled)
    impl->set_data_ptr_noswap(impl->allocator()->allocate(n));
    impl->set_nbytes(n);
    return;
  }
  c10::Storage fresh(c10::Storage::use_byte_size_t(), n, impl->allocator(), /*resizable=*/true);
  auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
  at::empty({0}, bytes).set_(fresh, 0, {keep}, {1}).copy_(at::empty({0}, bytes).set_(storage_at(impl), 0, {keep}, {1}));
  impl->set_data_ptr_noswap(std::move(fresh.unsafeGetStorageImpl()->mutable_data_ptr()));
  impl->set_nbytes(n);
}

// StorageImpl::swap_data_ptr where this torch has it (2.12 on), else the bytes and their sizes swapped.
template <typename S>
void swap_bytes(S* a, S* b) {
  if constexpr (requires { a->swap_data_ptr(*b); }) {
    a->swap_data_ptr(*b);
  } else {
    at::DataPtr mine = a->set_data_ptr(at::DataPtr(nullptr, a->device()));
    a->set_data_ptr(b->set_data_ptr(std::move(mine)));
    size_t na = a->nbytes();
    a->set_nbytes(b->nbytes());
    b->set_nbytes(na);
  }
}

PyObject* error_out(const std::exception& e) {
  if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "dtr._native: %s", e.what());
  return nullptr;
}

}  // namespace

// buffer_nbytes(buf_or_tensor) -> its storage's bytes; -1 if the buffer is gone (Buf.get() is None).
PyObject* buffer_nbytes(PyObject*, PyObject* o) {
  bool err;
  c10::StorageImpl* impl = impl_of(o, &err);
  if (err) return nullptr;
  return PyLong_FromLongLong(impl == nullptr ? -1 : static_cast<long long>(impl->nbytes()));
}

// buffer_key(tensor) -> its storage's address (UntypedStorage._cdata).
PyObject* buffer_key(PyObject*, PyObject* o) {
  bool err;
  c10::StorageImpl* impl = THPVariable_Check(o) ? impl_of(o, &err) : nullptr;
  if (impl == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "buffer_key(tensor): a tensor with a storage");
    return nullptr;
  }
  return PyLong_FromVoidPtr(impl);
}

// buffer_resize(buf, n) -> True once its storage holds n bytes; None if the buffer is gone; False if the
// storage cannot be resized (nothing done).
PyObject* buffer_resize(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "buffer_resize(buf, nbytes)");
    return nullptr;
  }
  bool err;
  c10::StorageImpl* impl = impl_of(args[0], &err);
  long long bytes = PyLong_AsLongLong(args[1]);
  if (err || (bytes == -1 && PyErr_Occurred())) return nullptr;
  if (impl == nullptr) Py_RETURN_NONE;
  if (!impl->resizable()) Py_RETURN_FALSE;
  try {
    resize_impl(impl, bytes);
  } catch (const std::exception& e) {
    return error_out(e);
  }
  Py_RETURN_TRUE;
}

// buffer_view(buf, dtype, offset, size, stride) -> a tensor over the (live) buffer's storage:
// torch.empty(0, dtype=dtype, device=...).set_(storage, offset, size, stride).
PyObject* buffer_view(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 5 || !THPDtype_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "buffer_view(buf, dtype, offset, size, stride)");
    return nullptr;
  }
  c10::StorageImpl* impl = live_impl(args[0]);
  long long offset = PyLong_AsLongLong(args[2]);
  if (impl == nullptr || (offset == -1 && PyErr_Occurred())) return nullptr;
  std::vector<int64_t> dims[2];
  for (int k = 0; k < 2; ++k) {
    Ref seq(PySequence_Fast(args[3 + k], "buffer_view: size and stride are sequences"));
    if (!seq) return nullptr;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.get()); ++i) {
      long long d = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq.get(), i));
      if (d == -1 && PyErr_Occurred()) return nullptr;
      dims[k].push_back(d);
    }
  }
  try {
    auto options = at::TensorOptions().dtype(reinterpret_cast<THPDtype*>(args[1])->scalar_type).device(impl->device());
    at::Tensor v = at::empty({0}, options).set_(storage_at(impl), offset, dims[0], dims[1]);
    return THPVariable_Wrap(std::move(v));
  } catch (const std::exception& e) {
    return error_out(e);
  }
}

// buffer_copy(dst, src): UntypedStorage.copy_ between two live buffers (the same number of bytes).
PyObject* buffer_copy(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "buffer_copy(dst, src)");
    return nullptr;
  }
  c10::StorageImpl* dst = live_impl(args[0]);
  c10::StorageImpl* src = dst == nullptr ? nullptr : live_impl(args[1]);
  if (src == nullptr) return nullptr;
  try {
    TORCH_CHECK(dst->nbytes() == src->nbytes(), "size does not match, self was ", dst->nbytes(),
                " bytes but src was ", src->nbytes(), " bytes");
    int64_t bytes = static_cast<int64_t>(dst->nbytes());
    auto d = at::TensorOptions().dtype(at::kByte).device(dst->device());
    auto s = at::TensorOptions().dtype(at::kByte).device(src->device());
    at::empty({0}, d).set_(storage_at(dst), 0, {bytes}, {1}).copy_(at::empty({0}, s).set_(storage_at(src), 0, {bytes}, {1}));
  } catch (const std::exception& e) {
    return error_out(e);
  }
  Py_RETURN_NONE;
}

// buffer_swap(dst, src): UntypedStorage._swap_data_ptr_ from the live buffer or tensor src's storage into the
// live buffer dst's (an evicted one: 0 bytes), which takes src's bytes; src's storage is left with dst's.
PyObject* buffer_swap(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "buffer_swap(dst, src)");
    return nullptr;
  }
  c10::StorageImpl* dst = live_impl(args[0]);
  c10::StorageImpl* src = dst == nullptr ? nullptr : live_impl(args[1]);
  if (src == nullptr) return nullptr;
  try {
    TORCH_CHECK(dst->device() == src->device(), "_swap_data_ptr_: storages must be on the same device");
    TORCH_CHECK(dst->nbytes() == src->nbytes() || dst->nbytes() == 0 || src->nbytes() == 0,
                "_swap_data_ptr_: storages must have the same nbytes or one must have 0");
    swap_bytes(dst, src);
  } catch (const std::exception& e) {
    return error_out(e);
  }
  Py_RETURN_NONE;
}

}  // namespace dtr::native
