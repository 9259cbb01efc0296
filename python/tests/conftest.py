"""Shared fixtures of the tessera pytest suite.

`dev` makes the tensors a test hands to tessera:
  - on a machine with a GPU and torch: real CUDA torch tensors (every test runs against the
    kernels);
  - without a GPU: NumPy memory exported through DLPack *as if* it were CUDA memory (FakeCudaArray).
    Validation reads only shapes, strides, dtypes and the host index copies, so every validation
    rule runs exactly as on a GPU; a call whose arguments are all valid gets past validation and
    fails at the first GPU step (no device), which the tests check too. Such arrays are never
    handed to a GPU (the mode exists only where there is none).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import tessera

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- GPU / torch detection ----------------------------------------------------------------------------

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    torch = None
    HAVE_TORCH = False

HAVE_GPU = tessera.device_count() > 0
HAVE_TORCH_GPU = HAVE_GPU and HAVE_TORCH and torch.cuda.is_available()
NO_GPU_REASON = "no CUDA GPU on this machine (%s)" % tessera.device_info().reason if not HAVE_GPU else ""

requires_gpu = pytest.mark.skipif(not HAVE_TORCH_GPU, reason=NO_GPU_REASON or "needs torch with CUDA")
requires_no_gpu = pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU behaviour; this machine has a GPU")


# ---- DLPack arrays that claim to be on a CUDA device ----------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", ctypes.c_void_p)]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

KDL_CUDA = 2
# dtype name -> (NumPy storage dtype, DLPack code, bits); bf16 is stored as uint16 bit patterns
_DL_TYPES = {"bf16": (np.uint16, 4, 16), "fp16": (np.float16, 2, 16), "fp32": (np.float32, 2, 32),
             "fp64": (np.float64, 2, 64), "int32": (np.int32, 0, 32), "int64": (np.int64, 0, 64)}


class FakeCudaArray:
    """A NumPy array exported through DLPack with a CUDA device type (or `device_type`)."""

    def __init__(self, host: np.ndarray, dtype: str, device_type: int = KDL_CUDA, device_id: int = 0):
        self.host, self.dtype, self.device_type, self.device_id = host, dtype, device_type, device_id
        self._keep = []

    @property
    def shape(self):
        return self.host.shape

    def __getitem__(self, key):
        return FakeCudaArray(self.host[key], self.dtype, self.device_type, self.device_id)

    def __dlpack_device__(self):
        return (self.device_type, self.device_id)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if max_version is not None:
            raise TypeError("this producer exports unversioned capsules only")
        a = self.host
        _, code, bits = _DL_TYPES[self.dtype]
        shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
        strides = (ctypes.c_int64 * max(a.ndim, 1))(*[s // a.itemsize for s in a.strides])
        managed = _DLManagedTensor()
        managed.dl_tensor.data = a.ctypes.data
        managed.dl_tensor.device = _DLDevice(self.device_type, self.device_id)
        managed.dl_tensor.ndim = a.ndim
        managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
        managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        managed.dl_tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        managed.deleter = None
        self._keep.append((shape, strides, managed))  # alive as long as this array
        return _PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)


class Devices:
    """Makes test tensors: torch CUDA tensors on a GPU machine, FakeCudaArrays elsewhere."""

    def __init__(self, real: bool):
        self.real = real

    def tensor(self, values: np.ndarray, dtype: str):
        """A device tensor of `dtype` holding `values` (rounded to dtype)."""
        if self.real:
            t = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                 "fp64": torch.float64, "int32": torch.int32, "int64": torch.int64}[dtype]
            return torch.from_numpy(np.ascontiguousarray(values)).to(device="cuda", dtype=t)
        storage, _, _ = _DL_TYPES[dtype]
        if dtype == "bf16":
            bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
            host = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        else:
            host = np.ascontiguousarray(values).astype(storage)
        return FakeCudaArray(host, dtype)

    def randn(self, shape, dtype: str = "bf16", seed: int = 0):
        return self.tensor(np.random.default_rng(seed).standard_normal(shape), dtype)

    def full(self, shape, value: float, dtype: str):
        return self.tensor(np.full(shape, value), dtype)

    def indices(self, values):
        return self.tensor(np.asarray(values, dtype=np.int32), "int32")

    def to_numpy(self, x) -> np.ndarray:
        """Values of a test tensor as float64 (or int) NumPy."""
        if self.real:
            return x.detach().float().cpu().numpy() if x.is_floating_point() else x.cpu().numpy()
        if x.dtype == "bf16":
            return (x.host.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return x.host.copy()


@pytest.fixture
def dev() -> Devices:
    if HAVE_GPU and not HAVE_TORCH_GPU:
        pytest.skip("a GPU without torch: the device-tensor tests use torch tensors there")
    return Devices(real=HAVE_TORCH_GPU)


def run_python(args, **kwargs):
    """Runs `python args...` with this interpreter and the same import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run([sys.executable] + list(args), capture_output=True, text=True, env=env,
                          timeout=600, **kwargs)
