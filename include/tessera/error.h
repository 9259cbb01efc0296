// tessera reports every rejected argument and every CUDA failure as a tessera::Error whose message
// names the entry point, the argument and the rule it broke, e.g.
//   tessera::append_paged_kv: argument 'kv_last_page_len': value 17 at index 3 is outside 1..16
// Nothing is written to any output when an entry point throws during validation.
#pragma once

#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace tessera
