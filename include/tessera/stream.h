// The CUDA stream type, declared without pulling the CUDA runtime headers into user code. The
// typedef is the runtime's own, so both headers can be included together.
#pragma once

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
