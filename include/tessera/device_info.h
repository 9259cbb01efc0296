// What the library sees of the GPU and which kernel path it will take there.
#pragma once

#include <cstddef>
#include <string>

namespace tessera {

// The kernel family the dispatcher uses on a given GPU.
enum class KernelPath : int {
  kNone = 0,          // no usable GPU: only the CPU reference path runs
  kPortableSm80 = 1,  // mma.sync + cp.async kernels; every GPU from sm_80 on
  kHopperSm90a = 2,   // TMA + wgmma + warp specialisation; sm_90 (H100/H200)
};

const char* kernel_path_name(KernelPath path);

// Which path a GPU of compute capability major.minor gets. sm_90 gets the Hopper path; any other
// capability >= 8.0 gets the portable path (a newer architecture runs the portable PTX, JIT-compiled
// by the driver); below 8.0 nothing is supported.
KernelPath kernel_path_for(int cc_major, int cc_minor);

struct DeviceInfo {
  bool present = false;  // false: no CUDA device (or no driver); the other fields are unset
  int device = -1;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int registers_per_sm = 0;            // 32-bit registers
  int max_registers_per_block = 0;
  std::size_t shared_memory_per_sm = 0;        // bytes
  std::size_t shared_memory_per_block = 0;     // default per-block limit, bytes
  std::size_t shared_memory_per_block_optin = 0;  // opt-in per-block limit, bytes
  std::size_t l2_bytes = 0;
  std::size_t global_memory_bytes = 0;         // HBM
  int memory_bus_width_bits = 0;
  int memory_clock_khz = 0;                    // 0 when the runtime does not report it
  int sm_clock_khz = 0;
  KernelPath path = KernelPath::kNone;
  std::string reason;  // why no device is present, when present == false
};

// Number of CUDA devices; 0 when there is no GPU or no driver (never throws).
int device_count();

// Properties of `device` (the current device when -1). Returns present == false with a reason when
// there is no usable GPU.
DeviceInfo device_info(int device = -1);

// What `tessera info` (and Python's `python -m tessera info`) prints: the library version, the GPU,
// its memory hierarchy and the kernel path, one fact per line, ending in a newline.
std::string info_text(const DeviceInfo& info);

}  // namespace tessera
