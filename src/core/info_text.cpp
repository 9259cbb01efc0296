// The text of `tessera info`, shared by the command and the Python package.
#include <cstdarg>
#include <cstdio>
#include <string>

#include "tessera/device_info.h"
#include "tessera/version.h"

namespace tessera {
namespace {

// printf into a std::string (the lines are short; 256 bytes covers the longest with room).
void append(std::string& out, const char* format, ...) {
  char line[256];
  va_list args;
  va_start(args, format);
  const int n = std::vsnprintf(line, sizeof(line), format, args);
  va_end(args);
  if (n > 0) out.append(line, static_cast<std::size_t>(n) < sizeof(line) ? n : sizeof(line) - 1);
}

}  // namespace

// The kernel families beside attention, and their shapes (include/tessera/moe.h).
constexpr const char* kMoeLine =
    "MoE: routing (top-k <= 32 of <= 512 experts; softmax / sigmoid, selection bias, grouped top-k) and "
    "permutation (<= 1024 experts, aligned segments); grouped GEMM (<= 1024 experts, K and N multiples of 8, "
    "SwiGLU epilogue; Hopper: TMA + wgmma, else mma.sync), combine, fused_moe (shared experts)\n";

std::string info_text(const DeviceInfo& info) {
  std::string out;
  append(out, "tessera %s\n", version());
  if (!info.present) {
    out += "GPU: none (" + info.reason + ")\nkernel path: " + kernel_path_name(KernelPath::kNone) + "\n";
    out += kMoeLine;
    return out;
  }
  const double kib = 1024.0, mib = kib * 1024, gib = mib * 1024;
  out += "GPU " + std::to_string(info.device) + ": " + info.name;
  append(out, ", compute capability %d.%d, %d SMs\n", info.cc_major, info.cc_minor, info.sm_count);
  append(out, "  registers: %d x 32-bit per SM (%d per block)\n", info.registers_per_sm,
         info.max_registers_per_block);
  append(out, "  shared memory: %.0f KiB per SM, %.0f KiB per block (%.0f KiB opt-in)\n",
         info.shared_memory_per_sm / kib, info.shared_memory_per_block / kib,
         info.shared_memory_per_block_optin / kib);
  append(out, "  L2: %.1f MiB\n", info.l2_bytes / mib);
  append(out, "  HBM: %.1f GiB, %d-bit bus", info.global_memory_bytes / gib, info.memory_bus_width_bits);
  if (info.memory_clock_khz > 0) {
    // DDR: two transfers per clock.
    const double peak = 2.0 * info.memory_clock_khz * 1e3 * info.memory_bus_width_bits / 8 / 1e12;
    append(out, ", %.0f MHz (%.2f TB/s peak by clock x width)", info.memory_clock_khz / 1e3, peak);
  }
  out += "\n";
  if (info.sm_clock_khz > 0) append(out, "  SM clock (max): %.0f MHz\n", info.sm_clock_khz / 1e3);
  out += std::string("kernel path: ") + kernel_path_name(info.path) + "\n";
  out += kMoeLine;
  return out;
}

}  // namespace tessera
