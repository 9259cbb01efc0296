// Everything a user of tessera includes.
#pragma once

#include "tessera/attention.h"
#include "tessera/decode.h"
#include "tessera/device_info.h"
#include "tessera/dtype.h"
#include "tessera/error.h"
#include "tessera/kv_cache.h"
#include "tessera/merge.h"
#include "tessera/moe.h"
#include "tessera/stream.h"
#include "tessera/tensor.h"
#include "tessera/version.h"
