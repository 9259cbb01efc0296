// Turns a fuzzer's bytes into bounded choices (the fuzz targets' only source of randomness), so
// that every input maps to some valid-looking or deliberately odd problem and the mutator's bit
// flips move between nearby problems.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return at_ >= size_; }
  // The next bytes as an unsigned integer (zeros once the input is used up).
  uint64_t bits(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v = v << 8 | (at_ < size_ ? data_[at_++] : 0);
    return v;
  }
  // An integer in [lo, hi].
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = uint64_t(hi - lo) + 1;
    return lo + int64_t(bits(span > 0xffff ? 4 : span > 0xff ? 2 : 1) % span);
  }
  bool flag() { return bits(1) & 1; }
  template <typename T, size_t N>
  T pick(const T (&options)[N]) {
    return options[range(0, N - 1)];
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

}  // namespace tessera::fuzz
