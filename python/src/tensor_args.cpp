#include "tensor_args.h"

#include <nanobind/stl/string.h>

#include <cuda_runtime_api.h>

#include <cctype>
#include <string>

#include "tessera/error.h"

namespace nb = nanobind;

namespace tessera::python {
namespace {

// DLPack device types (dlpack.h's DLDeviceType) that tessera can address.
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

// torch's Tensor type and the four dtypes tessera reads, looked up once torch has been imported by
// someone (tessera never imports it from C++). Leaked on purpose: they live as long as torch does.
struct TorchTypes {
  bool ready = false;
  PyObject* tensor_type = nullptr;
  PyObject* bf16 = nullptr;
  PyObject* fp16 = nullptr;
  PyObject* fp32 = nullptr;
  PyObject* int32 = nullptr;
  PyObject* name_dtype = nullptr;
  PyObject* name_is_cuda = nullptr;
  PyObject* name_is_cpu = nullptr;
  PyObject* name_get_device = nullptr;
  PyObject* name_shape = nullptr;
  PyObject* name_stride = nullptr;
  PyObject* name_data_ptr = nullptr;
};

TorchTypes& torch_types() {
  static TorchTypes* types = new TorchTypes();
  TorchTypes& t = *types;
  if (t.ready) return t;
  PyObject* modules = PyImport_GetModuleDict();  // borrowed
  PyObject* torch = PyDict_GetItemString(modules, "torch");  // borrowed; null until imported
  if (torch == nullptr) return t;
  nb::handle m(torch);
  if (!nb::hasattr(m, "Tensor") || !nb::hasattr(m, "bfloat16")) return t;  // mid-import
  t.tensor_type = m.attr("Tensor").inc_ref().ptr();
  t.bf16 = m.attr("bfloat16").inc_ref().ptr();
  t.fp16 = m.attr("float16").inc_ref().ptr();
  t.fp32 = m.attr("float32").inc_ref().ptr();
  t.int32 = m.attr("int32").inc_ref().ptr();
  t.name_dtype = nb::str("dtype").inc_ref().ptr();
  t.name_is_cuda = nb::str("is_cuda").inc_ref().ptr();
  t.name_is_cpu = nb::str("is_cpu").inc_ref().ptr();
  t.name_get_device = nb::str("get_device").inc_ref().ptr();
  t.name_shape = nb::str("shape").inc_ref().ptr();
  t.name_stride = nb::str("stride").inc_ref().ptr();
  t.name_data_ptr = nb::str("data_ptr").inc_ref().ptr();
  t.ready = true;
  return t;
}

std::string dlpack_dtype_name(nb::dlpack::dtype d) {
  const char* kind = nullptr;
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: kind = "bool"; break;
    default: return "DLPack type code " + std::to_string(d.code) + " (" + std::to_string(d.bits) + " bits)";
  }
  return std::string(kind) + std::to_string(d.bits);
}

bool dtype_of(nb::dlpack::dtype d, DType& out) {
  if (d.lanes != 1) return false;
  using code = nb::dlpack::dtype_code;
  const auto c = static_cast<code>(d.code);
  if (c == code::Bfloat && d.bits == 16) out = DType::kBF16;
  else if (c == code::Float && d.bits == 16) out = DType::kFP16;
  else if (c == code::Float && d.bits == 32) out = DType::kFP32;
  else if (c == code::Int && d.bits == 32) out = DType::kInt32;
  else return false;
  return true;
}

// obj.name() through vectorcall (no bound-method object), or a Python error.
nb::object call_method(nb::handle obj, PyObject* name) {
  PyObject* args[] = {obj.ptr()};
  PyObject* r = PyObject_VectorcallMethod(name, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

nb::object get_attr(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

constexpr const char* kSupportedDtypes = "(bf16, fp16, fp32, int32)";

}  // namespace

void ArgConverter::fail(const char* arg, const std::string& rule) const {
  throw Error(std::string("tessera::") + entry_ + ": argument '" + arg + "': " + rule);
}

void ArgConverter::note_device(const TensorView& view, int device_id, const char* arg) {
  if (view.device != Device::kCUDA) return;
  if (cuda_device_ < 0) {
    cuda_device_ = device_id;
  } else if (device_id != cuda_device_) {
    fail(arg, "is on cuda:" + std::to_string(device_id) + " but an earlier argument is on cuda:" +
                  std::to_string(cuda_device_) + " (all tensors of a call share one GPU)");
  }
}

bool ArgConverter::from_torch(nb::handle obj, const char* arg, TensorView& view) {
  TorchTypes& t = torch_types();
  if (!t.ready || !PyType_IsSubtype(Py_TYPE(obj.ptr()), reinterpret_cast<PyTypeObject*>(t.tensor_type))) {
    return false;
  }
  nb::object dtype = get_attr(obj, t.name_dtype);
  PyObject* d = dtype.ptr();
  if (d == t.bf16) view.dtype = DType::kBF16;
  else if (d == t.fp16) view.dtype = DType::kFP16;
  else if (d == t.fp32) view.dtype = DType::kFP32;
  else if (d == t.int32) view.dtype = DType::kInt32;
  else {
    // "torch.float64" -> "float64": the same words as for the same tensor through DLPack
    std::string name = nb::cast<std::string>(nb::str(dtype));
    if (name.compare(0, 6, "torch.") == 0) name = name.substr(6);
    fail(arg, "dtype " + name + " is not supported " + kSupportedDtypes);
  }

  int device_id = 0;
  if (get_attr(obj, t.name_is_cuda).ptr() == Py_True) {
    view.device = Device::kCUDA;
    device_id = static_cast<int>(PyLong_AsLong(call_method(obj, t.name_get_device).ptr()));
  } else if (get_attr(obj, t.name_is_cpu).ptr() == Py_True) {
    view.device = Device::kCPU;
  } else {
    fail(arg, "is on device '" + nb::cast<std::string>(nb::str(nb::object(obj.attr("device")))) +
                  "'; tessera reads CUDA tensors (and host index arrays)");
  }
  // torch.Size is a tuple subclass and stride() returns a tuple: read them as tuples (the
  // generic sequence protocol costs a Python call per element).
  nb::object shape = get_attr(obj, t.name_shape);
  nb::object stride = call_method(obj, t.name_stride);
  const Py_ssize_t rank = PyTuple_Size(shape.ptr());
  if (rank < 0 || PyTuple_Size(stride.ptr()) != rank) throw nb::python_error();
  if (rank > TensorView::kMaxRank) {
    fail(arg, "rank " + std::to_string(rank) + " exceeds " + std::to_string(TensorView::kMaxRank));
  }
  view.rank = static_cast<int>(rank);
  for (Py_ssize_t i = 0; i < rank; ++i) {
    view.shape[i] = PyLong_AsLongLong(PyTuple_GetItem(shape.ptr(), i));
    view.stride[i] = PyLong_AsLongLong(PyTuple_GetItem(stride.ptr(), i));
  }
  if (PyErr_Occurred()) throw nb::python_error();
  view.data = PyLong_AsVoidPtr(call_method(obj, t.name_data_ptr).ptr());
  if (PyErr_Occurred()) throw nb::python_error();
  note_device(view, device_id, arg);
  return true;
}

void ArgConverter::from_dlpack(nb::handle obj, const char* arg, TensorView& view) {
  if (num_held_ == kMaxHeld) fail(arg, "too many tensor arguments in one call");
  nb::ndarray<nb::ro>& a = held_[num_held_];
  if (!nb::try_cast(obj, a, /*convert=*/false)) {
    fail(arg, std::string("expected a tensor (any DLPack producer: torch, JAX, CuPy, NumPy), got ") +
                  nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))))));
  }
  ++num_held_;
  if (!dtype_of(a.dtype(), view.dtype)) {
    fail(arg, "dtype " + dlpack_dtype_name(a.dtype()) + " is not supported " + kSupportedDtypes);
  }
  switch (a.device_type()) {
    case kDLCUDA:
    case kDLCUDAManaged: view.device = Device::kCUDA; break;
    case kDLCPU:
    case kDLCUDAHost: view.device = Device::kCPU; break;
    default:
      fail(arg, "is on DLPack device type " + std::to_string(a.device_type()) +
                    "; tessera reads CUDA tensors (and host index arrays)");
  }
  if (a.ndim() > static_cast<size_t>(TensorView::kMaxRank)) {
    fail(arg, "rank " + std::to_string(a.ndim()) + " exceeds " + std::to_string(TensorView::kMaxRank));
  }
  view.rank = static_cast<int>(a.ndim());
  for (int i = 0; i < view.rank; ++i) {
    view.shape[i] = static_cast<int64_t>(a.shape(i));
    view.stride[i] = a.stride(i);
  }
  view.data = const_cast<void*>(a.data());
  note_device(view, a.device_id(), arg);
}

TensorView ArgConverter::tensor(nb::handle obj, const char* arg) {
  if (obj.is_none()) fail(arg, "is required (got None)");
  TensorView view;
  if (!from_torch(obj, arg, view)) from_dlpack(obj, arg, view);
  return view;
}

TensorView ArgConverter::optional(nb::handle obj, const char* arg) {
  return obj.is_none() ? TensorView() : tensor(obj, arg);
}

const int32_t* ArgConverter::host_indices_any(nb::handle obj, const char* arg, int64_t* length) {
  if (obj.is_none()) {
    *length = 0;
    return nullptr;
  }
  const TensorView v = tensor(obj, arg);
  if (v.device != Device::kCPU) fail(arg, "must be in host memory (a CPU array): it is the host copy");
  if (v.dtype != DType::kInt32) fail(arg, std::string("dtype must be int32, got ") + dtype_name(v.dtype));
  if (v.rank != 1) fail(arg, "must have rank 1, got rank " + std::to_string(v.rank));
  if (v.shape[0] > 1 && v.stride[0] != 1) {
    fail(arg, "must be contiguous (stride 1), got stride " + std::to_string(v.stride[0]));
  }
  *length = v.shape[0];
  return static_cast<const int32_t*>(v.data);
}

const int32_t* ArgConverter::host_indices(nb::handle obj, const char* arg, int64_t length) {
  int64_t n = 0;
  const int32_t* p = host_indices_any(obj, arg, &n);
  if (p != nullptr && n != length) {
    fail(arg, "has " + std::to_string(n) + " entries but its device array has " + std::to_string(length));
  }
  return p;
}

PagedKVCache ArgConverter::paged_cache(nb::handle k_pages, nb::handle v_pages, KVLayout layout) {
  PagedKVCache cache;
  cache.layout = layout;
  if (!v_pages.is_none()) {
    cache.k_pages = tensor(k_pages, "k_pages");
    cache.v_pages = tensor(v_pages, "v_pages");
    return cache;
  }
  // Combined [num_pages, 2, ...]: K is index 0 of dim 1, V index 1; both keep every other stride.
  const TensorView kv = tensor(k_pages, "kv_cache");
  if (kv.rank != 5 || kv.shape[1] != 2) {
    std::string shape;
    for (int i = 0; i < kv.rank; ++i) shape += (i ? ", " : "") + std::to_string(kv.shape[i]);
    fail("kv_cache", "a combined cache (v_pages None) must be [num_pages, 2, page_size, num_kv_heads, "
                     "head_dim] (NHD) or [num_pages, 2, num_kv_heads, page_size, head_dim] (HND), got [" +
                         shape + "]");
  }
  TensorView k = kv;
  k.rank = 4;
  k.shape[0] = kv.shape[0];
  k.stride[0] = kv.stride[0];
  for (int i = 1; i < 4; ++i) {
    k.shape[i] = kv.shape[i + 1];
    k.stride[i] = kv.stride[i + 1];
  }
  for (int i = 4; i < TensorView::kMaxRank; ++i) k.shape[i] = k.stride[i] = 0;
  TensorView v = k;
  v.data = static_cast<char*>(kv.data) + kv.stride[1] * static_cast<int64_t>(dtype_size(kv.dtype));
  cache.k_pages = k;
  cache.v_pages = v;
  return cache;
}

DeviceGuard::DeviceGuard(int device) {
  if (device < 0) return;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (current == device) return;
  if (cudaSetDevice(device) == cudaSuccess) {
    previous_ = current;
  } else {
    cudaGetLastError();  // validation or the launch reports the device problem
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

namespace {
std::string spelled(nb::handle obj) {
  std::string s = nb::cast<std::string>(nb::str(obj));
  for (const char* prefix : {"torch.", "DType.", "KVLayout.", "jnp.", "numpy."}) {
    const std::string p(prefix);
    if (s.compare(0, p.size(), p) == 0) s = s.substr(p.size());
  }
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
}  // namespace

DType parse_dtype(nb::handle obj, const char* entry_point, const char* arg) {
  DType d;
  if (nb::try_cast(obj, d, false)) return d;
  const std::string s = spelled(obj);
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp16" || s == "float16" || s == "half") return DType::kFP16;
  throw Error(std::string("tessera::") + entry_point + ": argument '" + arg +
              "': must be bf16 or fp16 (tessera.DType, a string or a framework dtype), got " +
              nb::cast<std::string>(nb::repr(obj)));
}

KVLayout parse_layout(nb::handle obj, const char* entry_point, const char* arg) {
  KVLayout layout;
  if (nb::try_cast(obj, layout, false)) return layout;
  const std::string s = spelled(obj);
  if (s == "nhd") return KVLayout::kNHD;
  if (s == "hnd") return KVLayout::kHND;
  throw Error(std::string("tessera::") + entry_point + ": argument '" + arg +
              "': must be 'NHD' or 'HND' (or tessera.KVLayout), got " + nb::cast<std::string>(nb::repr(obj)));
}

}  // namespace tessera::python
