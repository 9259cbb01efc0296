// The attention kernel families, named once: the public enums (AttentionPath for a forced choice,
// KernelPath for what `tessera info` reports), whether this build holds each family, and which
// GPUs run it. The dispatcher, device_info / `tessera info` and the tests read this list.
#pragma once

#include <vector>

#include "tessera/attention.h"
#include "tessera/device_info.h"

namespace tessera::dispatch {

struct KernelFamily {
  AttentionPath path;       // what PrefillArgs::path names it
  KernelPath kernel_path;   // what DeviceInfo::path reports
  const char* name;         // "portable", "hopper"
  const char* description;  // what it is built from
  bool built;               // in this build (TESSERA_HOPPER for the Hopper family)
  int min_cc, max_cc;       // compute capabilities (major * 10 + minor) that run its machine code
  bool runs_on(int cc_major, int cc_minor) const {
    const int cc = cc_major * 10 + cc_minor;
    return built && cc >= min_cc && cc <= max_cc;
  }
};

// Most specialised first: the first family that runs on a GPU is the one it takes.
const std::vector<KernelFamily>& kernel_families();
const KernelFamily* kernel_family(AttentionPath path);  // nullptr for kAuto

}  // namespace tessera::dispatch
