// Argument validation shared by every public entry point. Each failure throws tessera::Error naming
// the entry point, the argument and the rule:
//   tessera::merge_state: argument 's_a': dtype must be fp32, got bf16
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "tessera/error.h"
#include "tessera/tensor.h"

namespace tessera::detail {

class ArgCheck {
 public:
  explicit ArgCheck(const char* entry_point) : entry_(entry_point) {}

  [[noreturn]] void fail(const char* arg, const std::string& rule) const;
  void require(bool ok, const char* arg, const std::string& rule) const {
    if (!ok) fail(arg, rule);
  }

  // Non-null data (unless the tensor has no elements), right rank, on the expected device.
  void tensor(const TensorView& t, const char* arg, int rank, Device device = Device::kCUDA) const;
  void dtype(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const;
  void dim(const TensorView& t, const char* arg, int d, int64_t expected,
           const char* expected_name) const;
  // The last dim has stride 1, the data pointer and every other stride allow 16-byte vectors.
  void vectorizable_rows(const TensorView& t, const char* arg) const;
  void same_shape(const TensorView& a, const char* a_name, const TensorView& b,
                  const char* b_name) const;

  // Attention head configuration: num_kv_heads >= 1 divides num_qo_heads (GQA/MQA groups), and
  // head_dim is one of `supported` (the head dims this build instantiated).
  void head_config(int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_dim,
                   const std::vector<int>& supported) const;

  // A CSR offset array on the host: starts at 0, non-decreasing, ends at most at `max_end` (or
  // exactly at it when `exact_end`).
  void indptr_host(const int32_t* indptr, int64_t count, const char* arg, int64_t max_end,
                   bool exact_end) const;

 private:
  const char* entry_;
};

std::string shape_string(const TensorView& t);

}  // namespace tessera::detail
