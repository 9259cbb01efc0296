#include "dispatch/kernel_families.h"

#include <string>

#include "tessera_instantiations.h"

namespace tessera {
namespace dispatch {

const std::vector<KernelFamily>& kernel_families() {
  static const std::vector<KernelFamily> families = {
      // sm_90a machine code only: wgmma and setmaxnreg exist on sm_90 alone (not on sm_100+).
      {AttentionPath::kHopper, KernelPath::kHopperSm90a, "hopper", "sm_90a: TMA, wgmma, warp specialisation",
       TESSERA_INST_HOPPER != 0, 90, 90},
      // sm_80 / sm_90 machine code and compute_80 PTX, which the driver compiles for newer GPUs.
      {AttentionPath::kPortable, KernelPath::kPortableSm80, "portable", "sm_80: mma.sync, cp.async", true, 80,
       1000},
  };
  return families;
}

const KernelFamily* kernel_family(AttentionPath path) {
  for (const KernelFamily& f : kernel_families()) {
    if (f.path == path) return &f;
  }
  return nullptr;
}

}  // namespace dispatch

const char* attention_path_name(AttentionPath path) {
  if (path == AttentionPath::kAuto) return "auto";
  const dispatch::KernelFamily* f = dispatch::kernel_family(path);
  return f != nullptr ? f->name : "unknown";
}

const char* kernel_path_name(KernelPath path) {
  static const std::string names[] = {
      "none (CPU reference only)",
      std::string("portable (") + dispatch::kernel_family(AttentionPath::kPortable)->description + ")",
      std::string("hopper (") + dispatch::kernel_family(AttentionPath::kHopper)->description + ")",
  };
  const int i = static_cast<int>(path);
  return i >= 0 && i < 3 ? names[i].c_str() : "unknown";
}

KernelPath kernel_path_for(int cc_major, int cc_minor) {
  for (const dispatch::KernelFamily& f : dispatch::kernel_families()) {
    if (f.runs_on(cc_major, cc_minor)) return f.kernel_path;
  }
  return KernelPath::kNone;
}

}  // namespace tessera
