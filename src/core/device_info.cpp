#include "tessera/device_info.h"

#include <cuda_runtime_api.h>

namespace tessera {

// kernel_path_name and kernel_path_for read the family list (src/dispatch/kernel_families.cpp).

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return n;
}

namespace {
int attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return value;
}
}  // namespace

DeviceInfo device_info(int device) {
  DeviceInfo info;
  int n = 0;
  cudaError_t status = cudaGetDeviceCount(&n);
  if (status != cudaSuccess || n == 0) {
    info.reason = status != cudaSuccess ? std::string("no usable CUDA GPU or driver (cudaGetDeviceCount: ") +
                                              cudaGetErrorString(status) + ")"
                                        : std::string("no CUDA device found");
    cudaGetLastError();
    return info;
  }
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) device = 0;
  if (device >= n) {
    info.reason = "device " + std::to_string(device) + " does not exist (" + std::to_string(n) +
                  " devices)";
    return info;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    info.reason = "cudaGetDeviceProperties failed for device " + std::to_string(device);
    return info;
  }
  info.present = true;
  info.device = device;
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.registers_per_sm = prop.regsPerMultiprocessor;
  info.max_registers_per_block = prop.regsPerBlock;
  info.shared_memory_per_sm = prop.sharedMemPerMultiprocessor;
  info.shared_memory_per_block = prop.sharedMemPerBlock;
  info.shared_memory_per_block_optin = prop.sharedMemPerBlockOptin;
  info.l2_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  info.global_memory_bytes = prop.totalGlobalMem;
  info.memory_bus_width_bits = prop.memoryBusWidth;
  info.memory_clock_khz = attribute(cudaDevAttrMemoryClockRate, device);
  info.sm_clock_khz = attribute(cudaDevAttrClockRate, device);
  info.path = kernel_path_for(prop.major, prop.minor);
  return info;
}

}  // namespace tessera
