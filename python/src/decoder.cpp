// Bindings of tessera::BatchDecoder and DecodeConfig, and the little device memory the package
// needs when torch is not there to allocate (outputs, the decoder's workspace, index copies).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "tensor_args.h"
#include "tessera/tessera.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tessera::python {
namespace {

[[noreturn]] void cuda_fail(const char* what, cudaError_t status) {
  cudaGetLastError();
  throw Error(std::string("tessera: ") + what + " failed: " + cudaGetErrorString(status));
}

// A cudaMalloc'ed buffer owned by a Python object (freed when the last reference goes).
class DeviceBuffer {
 public:
  DeviceBuffer(size_t nbytes, int device) : nbytes_(nbytes), device_(device) {
    DeviceGuard guard(device);
    const cudaError_t status = cudaMalloc(&ptr_, nbytes == 0 ? 1 : nbytes);
    if (status != cudaSuccess) {
      ptr_ = nullptr;
      cuda_fail(("cudaMalloc of " + std::to_string(nbytes) + " bytes").c_str(), status);
    }
  }
  ~DeviceBuffer() {
    if (ptr_ == nullptr) return;
    DeviceGuard guard(device_);
    cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(ptr_); }
  size_t nbytes() const { return nbytes_; }
  int device() const { return device_; }

 private:
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  int device_ = 0;
};

nb::dlpack::dtype dlpack_dtype(DType d) {
  switch (d) {
    case DType::kBF16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::kFP16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kFP32: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 32, 1};
    case DType::kInt32: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Int), 32, 1};
    default: throw Error(std::string("tessera.empty: dtype ") + dtype_name(d) + " has no DLPack type here");
  }
}

// A contiguous CUDA array of `shape`. It is returned as an object with __dlpack__ and
// __dlpack_device__ (nanobind's array-API export), not as a bare DLPack capsule: a capsule can be
// consumed once only, so one handed to a tessera call as `out` could not then be given to
// cupy.from_dlpack, and jax.dlpack.from_dlpack takes no capsules at all. Each __dlpack__ call
// makes a new capsule that keeps the buffer alive.
nb::ndarray<nb::array_api> empty_device(const std::vector<int64_t>& shape, DType dtype, int device) {
  size_t count = 1;
  std::vector<size_t> dims;
  for (int64_t s : shape) {
    if (s < 0) throw Error("tessera.empty: negative size in shape");
    dims.push_back(static_cast<size_t>(s));
    count *= static_cast<size_t>(s);
  }
  nb::object owner = nb::cast(new DeviceBuffer(count * dtype_size(dtype), device), nb::rv_policy::take_ownership);
  void* data = reinterpret_cast<void*>(nb::cast<DeviceBuffer&>(owner).ptr());
  return nb::ndarray<nb::array_api>(data, dims.size(), dims.data(), owner, nullptr, dlpack_dtype(dtype),
                                    nb::device::cuda::value, device);
}

size_t contiguous_bytes(ArgConverter& conv, const TensorView& t, const char* arg) {
  if (!t.is_contiguous()) conv.fail(arg, "must be contiguous, got " + t.describe());
  return static_cast<size_t>(t.numel()) * dtype_size(t.dtype);
}

// DecodeConfig(num_qo_heads=..., ...): keyword construction with the C++ defaults; dtype and layout
// also accept strings and framework dtypes.
DecodeConfig make_config(int num_qo_heads, int num_kv_heads, int head_dim, int page_size,
                         nb::handle dtype, nb::handle layout, int max_batch_size, int max_qo_len,
                         bool causal, int window_left, float scale, float soft_cap,
                         int pipeline_stages, int ctas_per_sm, bool programmatic_launch, bool batch_invariant,
                         int batch_invariant_chunk_tokens, int batch_invariant_max_chunks) {
  DecodeConfig c;
  c.num_qo_heads = num_qo_heads;
  c.num_kv_heads = num_kv_heads;
  c.head_dim = head_dim;
  c.page_size = page_size;
  c.dtype = parse_dtype(dtype, "DecodeConfig", "dtype");
  c.layout = parse_layout(layout, "DecodeConfig", "layout");
  c.max_batch_size = max_batch_size;
  c.max_qo_len = max_qo_len;
  c.causal = causal;
  c.window_left = window_left;
  c.scale = scale;
  c.soft_cap = soft_cap;
  c.pipeline_stages = pipeline_stages;
  c.ctas_per_sm = ctas_per_sm;
  c.programmatic_launch = programmatic_launch;
  c.batch_invariant = batch_invariant;
  c.batch_invariant_chunk_tokens = batch_invariant_chunk_tokens;
  c.batch_invariant_max_chunks = batch_invariant_max_chunks;
  return c;
}

std::string config_repr(const DecodeConfig& c) {
  return "DecodeConfig(num_qo_heads=" + std::to_string(c.num_qo_heads) +
         ", num_kv_heads=" + std::to_string(c.num_kv_heads) + ", head_dim=" + std::to_string(c.head_dim) +
         ", page_size=" + std::to_string(c.page_size) + ", dtype='" + dtype_name(c.dtype) +
         "', layout='" + kv_layout_name(c.layout) + "', max_batch_size=" + std::to_string(c.max_batch_size) +
         ", max_qo_len=" + std::to_string(c.max_qo_len) + ", causal=" + (c.causal ? "True" : "False") +
         ", window_left=" + std::to_string(c.window_left) + ", scale=" + std::to_string(c.scale) +
         ", soft_cap=" + std::to_string(c.soft_cap) + ", pipeline_stages=" + std::to_string(c.pipeline_stages) +
         ", ctas_per_sm=" + std::to_string(c.ctas_per_sm) +
         ", programmatic_launch=" + (c.programmatic_launch ? "True" : "False") +
         ", batch_invariant=" + (c.batch_invariant ? "True" : "False") +
         ", batch_invariant_chunk_tokens=" + std::to_string(c.batch_invariant_chunk_tokens) +
         ", batch_invariant_max_chunks=" + std::to_string(c.batch_invariant_max_chunks) + ")";
}

// tessera::BatchDecoder on a device workspace the Python side owns (and keeps alive).
class Decoder {
 public:
  Decoder(const DecodeConfig& config, uintptr_t workspace, size_t workspace_size, int device)
      : device_(device) {
    DeviceGuard guard(device);
    decoder_ = std::make_unique<BatchDecoder>(config, reinterpret_cast<void*>(workspace), workspace_size);
  }

  static size_t workspace_bytes(const DecodeConfig& config, int device) {
    DeviceGuard guard(device);
    return BatchDecoder::workspace_bytes(config);
  }

  void plan(nb::handle host_qo_indptr, nb::handle host_kv_indptr, nb::handle host_kv_indices,
            nb::handle host_kv_last_page_len, int64_t num_pages, uintptr_t stream) {
    ArgConverter conv("BatchDecoder::plan");
    int64_t n_indptr = 0, n_qo = 0, n_indices = 0, n_last = 0;
    PageTable table;
    table.host_indptr = conv.host_indices_any(host_kv_indptr, "kv_indptr", &n_indptr);
    const int32_t* qo = conv.host_indices_any(host_qo_indptr, "qo_indptr", &n_qo);
    table.host_indices = conv.host_indices_any(host_kv_indices, "kv_indices", &n_indices);
    table.host_last_page_len = conv.host_indices_any(host_kv_last_page_len, "kv_last_page_len", &n_last);
    // The library reads batch + 1 entries of each indptr, batch of last_page_len and kv_indptr[batch]
    // of kv_indices through these pointers: the lengths must hold them.
    if (qo == nullptr) conv.fail("qo_indptr", "is required");
    if (table.host_indptr == nullptr) conv.fail("kv_indptr", "is required");
    if (table.host_indices == nullptr) conv.fail("kv_indices", "is required");
    if (table.host_last_page_len == nullptr) conv.fail("kv_last_page_len", "is required");
    if (n_indptr < 1) conv.fail("kv_indptr", "must have batch_size + 1 >= 1 entries");
    if (n_qo != n_indptr) {
      conv.fail("qo_indptr", "has " + std::to_string(n_qo) + " entries but kv_indptr has " +
                                 std::to_string(n_indptr) + " (both are batch_size + 1)");
    }
    if (n_last != n_indptr - 1) {
      conv.fail("kv_last_page_len", "has " + std::to_string(n_last) + " entries, must equal the batch size " +
                                        std::to_string(n_indptr - 1));
    }
    if (table.host_indptr[n_indptr - 1] > n_indices) {
      conv.fail("kv_indices", "has " + std::to_string(n_indices) + " entries but kv_indptr ends at " +
                                  std::to_string(table.host_indptr[n_indptr - 1]));
    }
    table.indptr = TensorView::contiguous(const_cast<int32_t*>(table.host_indptr), DType::kInt32,
                                          {n_indptr}, Device::kCPU);
    DeviceGuard guard(device_);
    decoder_->plan(qo, table, as_stream(stream), num_pages);
  }

  // Converts run()'s arguments; `conv` keeps the imported tensors alive while they are used.
  struct RunArgs {
    TensorView q, o, lse;
    PagedKVCache cache;
    PageTable table;
  };
  RunArgs run_args(ArgConverter& conv, nb::handle q, nb::handle k_pages, nb::handle v_pages,
                   nb::handle kv_indices, nb::handle o, nb::handle lse) const {
    RunArgs a;
    a.q = conv.tensor(q, "q");
    a.cache = conv.paged_cache(k_pages, v_pages, decoder_->config().layout);
    a.table.indices = conv.tensor(kv_indices, "kv_indices");
    a.o = conv.tensor(o, "o");
    a.lse = conv.optional(lse, "lse");
    return a;
  }

  // Returns whether the stream was being captured into a CUDA graph (the Python side then pins
  // the device page ids' address).
  bool run(nb::handle q, nb::handle k_pages, nb::handle v_pages, nb::handle kv_indices, nb::handle o,
           nb::handle lse, uintptr_t stream) {
    ArgConverter conv("BatchDecoder::run");
    const RunArgs a = run_args(conv, q, k_pages, v_pages, kv_indices, o, lse);
    DeviceGuard guard(device_);
    decoder_->run(a.q, a.cache, a.table, a.o, a.lse, as_stream(stream));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(as_stream(stream), &capture) != cudaSuccess) cudaGetLastError();
    return capture != cudaStreamCaptureStatusNone;
  }

  // The C++ call's own host cost, for the Python-overhead benchmark: `iterations` back-to-back
  // run() calls on arguments converted once, in host seconds per call (the caller synchronizes).
  double host_seconds_per_run(nb::handle q, nb::handle k_pages, nb::handle v_pages,
                              nb::handle kv_indices, nb::handle o, nb::handle lse, uintptr_t stream,
                              int iterations) {
    ArgConverter conv("BatchDecoder::run");
    const RunArgs a = run_args(conv, q, k_pages, v_pages, kv_indices, o, lse);
    DeviceGuard guard(device_);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) decoder_->run(a.q, a.cache, a.table, a.o, a.lse, as_stream(stream));
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double>(t1 - t0).count() / std::max(iterations, 1);
  }

  const DecodeConfig& config() const { return decoder_->config(); }
  DecodePlanInfo last_plan() const { return decoder_->last_plan(); }
  int device() const { return device_; }

 private:
  int device_;
  std::unique_ptr<BatchDecoder> decoder_;
};

}  // namespace

void bind_memory(nb::module_& m) {
  nb::class_<DeviceBuffer>(m, "DeviceBuffer",
                           "A cudaMalloc'ed buffer, freed with its last reference (used when torch "
                           "does not allocate: decoder workspaces, outputs of non-torch inputs).")
      .def(nb::init<size_t, int>(), "nbytes"_a, "device"_a)
      .def_prop_ro("ptr", &DeviceBuffer::ptr, "Device address.")
      .def_prop_ro("nbytes", &DeviceBuffer::nbytes)
      .def_prop_ro("device", &DeviceBuffer::device);

  m.def("empty", &empty_device, "shape"_a, "dtype"_a, "device"_a,
        "A new contiguous CUDA array (uninitialised): an object with __dlpack__ and "
        "__dlpack_device__, which any framework's from_dlpack takes, as often as needed.");
  m.def(
      "tensor_info",
      [](nb::handle x, const std::string& entry, const std::string& arg) {
        ArgConverter conv(entry.c_str());
        const TensorView t = conv.tensor(x, arg.c_str());
        nb::list shape;
        for (int i = 0; i < t.rank; ++i) shape.append(t.shape[i]);
        return nb::make_tuple(t.dtype, t.device == Device::kCUDA, conv.cuda_device(), nb::tuple(shape));
      },
      "x"_a, "entry"_a, "arg"_a,
      "(DType, on a CUDA device, device id, shape) of a tensor, as the bindings read it; "
      "tessera.Error naming `entry` and `arg` when they cannot.");
  m.def(
      "view_description",
      [](nb::handle x, nb::handle v_pages, nb::handle layout) {
        ArgConverter conv("view_description");
        if (layout.is_none()) return nb::make_tuple(conv.tensor(x, "x").describe());
        const PagedKVCache c = conv.paged_cache(x, v_pages, parse_layout(layout, "view_description", "layout"));
        const auto offset = reinterpret_cast<uintptr_t>(c.v_pages.data) - reinterpret_cast<uintptr_t>(c.k_pages.data);
        return nb::make_tuple(c.k_pages.describe(), c.v_pages.describe(), offset);
      },
      "x"_a, "v_pages"_a.none() = nb::none(), "layout"_a.none() = nb::none(),
      "The TensorView(s) the bindings make of a tensor, as text (shape, dtype, strides, device); "
      "with a layout, of a paged cache (k_pages, v_pages or a combined one), with V's byte offset "
      "from K. For tests and debugging.");
  m.def(
      "copy_async",
      [](nb::handle dst, nb::handle src, uintptr_t stream) {
        ArgConverter conv("copy_async");
        const TensorView d = conv.tensor(dst, "dst"), s = conv.tensor(src, "src");
        const size_t nbytes = contiguous_bytes(conv, s, "src");
        if (contiguous_bytes(conv, d, "dst") < nbytes) conv.fail("dst", "is smaller than src");
        if (nbytes == 0) return;
        DeviceGuard guard(conv.cuda_device());
        const cudaError_t status = cudaMemcpyAsync(d.data, s.data, nbytes, cudaMemcpyDefault, as_stream(stream));
        if (status != cudaSuccess) cuda_fail("cudaMemcpyAsync", status);
      },
      "dst"_a, "src"_a, "stream"_a,
      "Copies contiguous src into the start of contiguous dst (host or device; dst holds at "
      "least src's bytes), asynchronously on stream.");
  m.def(
      "buffer_address",
      [](nb::handle x) {
        nb::ndarray<nb::ro> a;
        if (!nb::try_cast(x, a, false)) throw Error("tessera: a buffer must be a DLPack array");
        size_t count = 1;
        int64_t expected = 1;
        for (size_t i = a.ndim(); i-- > 0;) {
          if (a.shape(i) != 1 && a.stride(i) != expected) throw Error("tessera: a buffer must be contiguous");
          expected *= static_cast<int64_t>(a.shape(i));
          count *= a.shape(i);
        }
        return nb::make_tuple(reinterpret_cast<uintptr_t>(a.data()), count * a.itemsize());
      },
      "x"_a, "(address, bytes) of a contiguous DLPack array of any dtype (a workspace).");
  m.def(
      "stream_synchronize",
      [](uintptr_t stream) {
        const cudaError_t status = cudaStreamSynchronize(as_stream(stream));
        if (status != cudaSuccess) cuda_fail("cudaStreamSynchronize", status);
      },
      "stream"_a, "Waits for the stream's work to finish.");
  m.def(
      "stream_is_capturing",
      [](uintptr_t stream) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(as_stream(stream), &status) != cudaSuccess) {
          cudaGetLastError();
          return false;
        }
        return status != cudaStreamCaptureStatusNone;
      },
      "stream"_a, "Whether the stream is being captured into a CUDA graph.");
  m.def(
      "current_device",
      []() {
        int device = -1;
        if (cudaGetDevice(&device) != cudaSuccess) {
          cudaGetLastError();
          return -1;
        }
        return device;
      },
      "The CUDA runtime's current device of this thread; -1 without a GPU.");
}

void bind_decoder(nb::module_& m) {
  const DecodeConfig d;
  nb::class_<DecodeConfig>(m, "DecodeConfig",
                           "A BatchDecoder's fixed configuration (tessera::DecodeConfig): head "
                           "counts, head_dim, page size, dtype, layout, capacity and variant.")
      .def("__init__",
           [](DecodeConfig* self, int num_qo_heads, int num_kv_heads, int head_dim, int page_size,
              nb::handle dtype, nb::handle layout, int max_batch_size, int max_qo_len, bool causal,
              int window_left, float scale, float soft_cap, int pipeline_stages, int ctas_per_sm,
              bool programmatic_launch, bool batch_invariant, int batch_invariant_chunk_tokens,
              int batch_invariant_max_chunks) {
             new (self) DecodeConfig(make_config(num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                                                 layout, max_batch_size, max_qo_len, causal, window_left,
                                                 scale, soft_cap, pipeline_stages, ctas_per_sm,
                                                 programmatic_launch, batch_invariant, batch_invariant_chunk_tokens,
                                                 batch_invariant_max_chunks));
           },
           nb::kw_only(), "num_qo_heads"_a = d.num_qo_heads, "num_kv_heads"_a = d.num_kv_heads,
           "head_dim"_a = d.head_dim, "page_size"_a = d.page_size, "dtype"_a = "bf16",
           "layout"_a = "NHD", "max_batch_size"_a = d.max_batch_size, "max_qo_len"_a = d.max_qo_len,
           "causal"_a = d.causal, "window_left"_a = d.window_left, "scale"_a = d.scale,
           "soft_cap"_a = d.soft_cap, "pipeline_stages"_a = d.pipeline_stages,
           "ctas_per_sm"_a = d.ctas_per_sm, "programmatic_launch"_a = d.programmatic_launch,
           "batch_invariant"_a = d.batch_invariant,
           "batch_invariant_chunk_tokens"_a = d.batch_invariant_chunk_tokens,
           "batch_invariant_max_chunks"_a = d.batch_invariant_max_chunks,
           "Fields as in include/tessera/decode.h; dtype 'bf16' | 'fp16' (or a DType / framework "
           "dtype), layout 'NHD' | 'HND'. Validated when a BatchDecoder is made.")
      .def_rw("num_qo_heads", &DecodeConfig::num_qo_heads)
      .def_rw("num_kv_heads", &DecodeConfig::num_kv_heads)
      .def_rw("head_dim", &DecodeConfig::head_dim)
      .def_rw("page_size", &DecodeConfig::page_size)
      .def_rw("dtype", &DecodeConfig::dtype)
      .def_rw("layout", &DecodeConfig::layout)
      .def_rw("max_batch_size", &DecodeConfig::max_batch_size)
      .def_rw("max_qo_len", &DecodeConfig::max_qo_len)
      .def_rw("causal", &DecodeConfig::causal)
      .def_rw("window_left", &DecodeConfig::window_left)
      .def_rw("scale", &DecodeConfig::scale)
      .def_rw("soft_cap", &DecodeConfig::soft_cap)
      .def_rw("pipeline_stages", &DecodeConfig::pipeline_stages)
      .def_rw("ctas_per_sm", &DecodeConfig::ctas_per_sm)
      .def_rw("programmatic_launch", &DecodeConfig::programmatic_launch)
      .def_rw("batch_invariant", &DecodeConfig::batch_invariant)
      .def_rw("batch_invariant_chunk_tokens", &DecodeConfig::batch_invariant_chunk_tokens)
      .def_rw("batch_invariant_max_chunks", &DecodeConfig::batch_invariant_max_chunks)
      .def("__repr__", &config_repr);

  nb::class_<DecodePlanInfo>(m, "DecodePlanInfo", "What the last plan() decided (tessera::DecodePlanInfo).")
      .def_ro("num_work_items", &DecodePlanInfo::num_work_items)
      .def_ro("num_split_requests", &DecodePlanInfo::num_split_requests)
      .def_ro("num_merge_rows", &DecodePlanInfo::num_merge_rows)
      .def_ro("chunk_tokens", &DecodePlanInfo::chunk_tokens)
      .def_ro("estimated_us", &DecodePlanInfo::estimated_us)
      .def_ro("grid_ctas", &DecodePlanInfo::grid_ctas)
      .def_ro("ctas_per_sm", &DecodePlanInfo::ctas_per_sm);

  nb::class_<Decoder>(m, "BatchDecoder",
                      "tessera::BatchDecoder on a caller-owned workspace (see tessera.BatchDecoder "
                      "for the Python API, which owns one).")
      .def(nb::init<const DecodeConfig&, uintptr_t, size_t, int>(), "config"_a, "workspace"_a,
           "workspace_size"_a, "device"_a)
      .def_static("workspace_bytes", &Decoder::workspace_bytes, "config"_a, "device"_a,
                  "Device workspace bytes a decoder with this config needs on `device`.")
      .def("plan", &Decoder::plan, "host_qo_indptr"_a, "host_kv_indptr"_a, "host_kv_indices"_a,
           "host_kv_last_page_len"_a, "num_pages"_a, "stream"_a,
           "Plans a step from host int32 arrays; one async copy into the workspace on stream.")
      .def("run", &Decoder::run, "q"_a, "k_pages"_a, "v_pages"_a.none(), "kv_indices"_a, "o"_a,
           "lse"_a.none(), "stream"_a,
           "Runs the planned step for one layer on stream; returns whether the stream was being "
           "captured into a CUDA graph.")
      .def("host_seconds_per_run", &Decoder::host_seconds_per_run, "q"_a, "k_pages"_a,
           "v_pages"_a.none(), "kv_indices"_a, "o"_a, "lse"_a.none(), "stream"_a, "iterations"_a,
           "Benchmark helper: host seconds per C++ run() call over `iterations` calls on "
           "arguments converted once.")
      .def_prop_ro("config", &Decoder::config)
      .def_prop_ro("last_plan", &Decoder::last_plan)
      .def_prop_ro("device", &Decoder::device);
}

}  // namespace tessera::python
