// Device-side range checks of the data only the device sees (index arrays read by the kernels,
// whose host copies were validated but whose device copies may differ; expert offsets; the
// combine's inverse map). Compiled in with TESSERA_DEVICE_CHECKS=1 (the CMake option of that name,
// on in Debug builds), out otherwise: a release kernel's machine code does not change. A failed
// check prints what broke and traps, which ends the kernel with cudaErrorLaunchFailure (the
// context is lost, as after any device fault) instead of reading or writing out of bounds.
// Kept out of the Hopper consumers' code (a branch between wgmma issues serialises them, C7520):
// there the producer checks what both read, with TESSERA_DEVICE_CHECK_QUIET: no message, since
// printf is a function call and any call in a kernel with wgmma serialises them all (C7510); the
// trap's source line shows under compute-sanitizer (the kernels carry -lineinfo).
#pragma once

#include <cstdio>

#ifndef TESSERA_DEVICE_CHECKS
#define TESSERA_DEVICE_CHECKS 0
#endif

#if TESSERA_DEVICE_CHECKS
#define TESSERA_DEVICE_CHECK(cond, what)                                                                  \
  do {                                                                                                    \
    if (!(cond)) {                                                                                        \
      printf("tessera: device check failed in block (%d, %d, %d) thread %d: %s (%s:%d)\n", blockIdx.x,     \
             blockIdx.y, blockIdx.z, threadIdx.x, what, __FILE__, __LINE__);                              \
      __trap();                                                                                           \
    }                                                                                                     \
  } while (0)
#define TESSERA_DEVICE_CHECK_QUIET(cond, what) \
  do {                                         \
    if (!(cond)) __trap();                     \
  } while (0)
#else
#define TESSERA_DEVICE_CHECK(cond, what) \
  do {                                   \
  } while (0)
#define TESSERA_DEVICE_CHECK_QUIET(cond, what) \
  do {                                         \
  } while (0)
#endif
