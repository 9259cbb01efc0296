#include "tessera/tensor.h"

#include <sstream>

#include "tessera/error.h"

namespace tessera {

namespace {
void set_shape(TensorView& t, std::initializer_list<int64_t> shape) {
  if (shape.size() > static_cast<std::size_t>(TensorView::kMaxRank)) {
    throw Error("tessera::TensorView: rank " + std::to_string(shape.size()) + " exceeds " +
                std::to_string(TensorView::kMaxRank));
  }
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
}
}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  set_shape(t, shape);
  int64_t s = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.stride[i] = s;
    s *= t.shape[i];
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> stride, Device device) {
  if (shape.size() != stride.size()) {
    throw Error("tessera::TensorView::strided: shape has " + std::to_string(shape.size()) +
                " dims but stride has " + std::to_string(stride.size()));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  set_shape(t, shape);
  int i = 0;
  for (int64_t s : stride) t.stride[i++] = s;
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < rank; ++i) os << (i ? ", " : "") << shape[i];
  os << "] " << dtype_name(dtype) << " strides [";
  for (int i = 0; i < rank; ++i) os << (i ? ", " : "") << stride[i];
  os << "] " << (device == Device::kCUDA ? "cuda" : "cpu");
  return os.str();
}

}  // namespace tessera
