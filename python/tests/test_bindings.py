"""The binding layer on any machine: argument conversion (DLPack views, strides, combined caches,
host index arrays, streams), the CPU-only paths (NumPy arrays, tessera.info), packaging."""
import os
import re
import subprocess

import numpy as np
import pytest

import tessera
from tessera import _tensors, _tessera
from conftest import HAVE_TORCH, REPO, FakeCudaArray, run_python

HEAD_DIM = 128


def view(x):
    return _tessera.view_description(x)[0]


# ---- conversion ----------------------------------------------------------------------------------

def test_numpy_arrays_through_dlpack_keep_shape_dtype_and_strides():
    a = np.zeros((6, 4, 32), np.float16)
    assert view(a) == "[6, 4, 32] fp16 strides [128, 32, 1] cpu"
    assert view(a[::2, 1:3]) == "[3, 2, 32] fp16 strides [256, 32, 1] cpu"
    assert view(np.zeros((3, 5), np.float32).T) == "[5, 3] fp32 strides [1, 5] cpu"
    assert view(np.arange(4, dtype=np.int32)) == "[4] int32 strides [1] cpu"


def test_fake_cuda_arrays_are_device_views(dev):
    x = dev.randn((6, 4, 32), "bf16")
    if isinstance(x, FakeCudaArray):
        assert view(x) == "[6, 4, 32] bf16 strides [128, 32, 1] cuda"
        assert view(x[:, 1:3]) == "[6, 2, 32] bf16 strides [128, 32, 1] cuda"
    else:
        assert view(x).endswith("cuda")


def test_unsupported_dtypes_devices_and_objects_name_the_argument():
    with pytest.raises(tessera.Error, match=r"^tessera::x: argument 'y': dtype float64 is not supported"):
        _tessera.tensor_info(np.zeros(3), "x", "y")
    with pytest.raises(tessera.Error, match="dtype int64 is not supported"):
        _tessera.tensor_info(np.zeros(3, np.int64), "x", "y")
    with pytest.raises(tessera.Error, match="dtype bool8 is not supported"):
        _tessera.tensor_info(np.zeros(3, bool), "x", "y")
    vulkan = FakeCudaArray(np.zeros(4, np.float16), "fp16", device_type=7)
    with pytest.raises(tessera.Error, match="is on DLPack device type 7"):
        _tessera.tensor_info(vulkan, "x", "y")
    with pytest.raises(tessera.Error, match=r"^tessera::batch_prefill: argument 'q': expected a tensor .* got <class 'str'>"):
        tessera.batch_prefill("q", None, None, [0], [0], out=np.zeros((1, 1, 8), np.float16))


def test_tensors_of_one_call_share_a_device():
    a = FakeCudaArray(np.zeros((4, 2, 64), np.uint16), "bf16", device_id=0)
    b = FakeCudaArray(np.zeros((4, 2, 64), np.uint16), "bf16", device_id=1)
    s = FakeCudaArray(np.zeros((4, 2), np.float32), "fp32")
    with pytest.raises(tessera.Error, match="argument 'o_b': is on cuda:1 but an earlier argument is on cuda:0"):
        _tessera.merge_state(a, s, b, s, a, None, 0)


def test_combined_cache_is_split_into_two_strided_views():
    kv = FakeCudaArray(np.zeros((6, 2, 16, 4, 128), np.uint16), "bf16")
    k, v, offset = _tessera.view_description(kv, None, "NHD")
    assert k == "[6, 16, 4, 128] bf16 strides [16384, 512, 128, 1] cuda"
    assert v == k
    assert offset == 8192 * 2  # V starts one dim-1 step (16 * 4 * 128 elements) after K
    k_sep = FakeCudaArray(np.zeros((6, 16, 4, 128), np.uint16), "bf16")
    assert _tessera.view_description(k_sep, k_sep, "HND")[0] == "[6, 16, 4, 128] bf16 strides [8192, 512, 128, 1] cuda"


def test_host_index_arrays_from_lists_and_numpy():
    assert _tensors.host_array([0, 3, 5]).dtype == np.int32
    x = np.array([0, 1], np.int64)
    assert _tensors.host_array(x) is x  # no silent conversion of arrays: the binding rejects int64


def test_index_pair_keeps_device_arrays_and_given_host_copies(dev):
    d = dev.indices([0, 2, 5])
    h = np.array([0, 2, 5], np.int32)
    device, host = _tensors.index_pair("e", "qo_indptr", d, h, like=d, stream=0)
    assert device is d and host is h


def test_stream_handles():
    class TorchLike:
        cuda_stream = 1234

    class Protocol:
        def __cuda_stream__(self):
            return (0, 77)

    class CupyLike:
        ptr = 99

    assert _tensors.stream_handle(5) == 5
    assert _tensors.stream_handle(TorchLike()) == 1234
    assert _tensors.stream_handle(Protocol()) == 77
    assert _tensors.stream_handle(CupyLike()) == 99
    with pytest.raises(TypeError, match="stream must be"):
        _tensors.stream_handle("default")
    assert _tensors.resolve_stream(None, np.zeros(1)) == 0


def test_outputs_of_numpy_inputs_are_numpy_and_errors_leave_them_unwritten():
    q = np.zeros((4, 2, 64), np.float16)
    out = np.full_like(q, 3.0)
    with pytest.raises(tessera.Error, match="argument 'k': must be in device memory"):
        tessera.batch_prefill(q, q, q, [0, 4], [0, 4], out=out)
    assert np.all(out == 3.0)
    assert isinstance(_tensors.empty_like(q, "e", "q"), np.ndarray)


def test_decode_config_keywords_and_spellings():
    c = tessera.DecodeConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="fp16",
                             layout="hnd", max_batch_size=64, max_qo_len=4)
    assert (c.dtype, c.layout, c.max_qo_len, c.causal) == (tessera.DType.FP16, tessera.KVLayout.HND, 4, True)
    assert tessera.DecodeConfig(dtype="torch.bfloat16").dtype == tessera.DType.BF16
    assert tessera.DecodeConfig(dtype=tessera.DType.FP16).dtype == tessera.DType.FP16
    assert "num_qo_heads=32" in repr(c)
    assert (c.batch_invariant, c.batch_invariant_chunk_tokens, c.batch_invariant_max_chunks) == (False, 1024, 0)
    inv = tessera.DecodeConfig(batch_invariant=True, batch_invariant_chunk_tokens=1024, batch_invariant_max_chunks=512)
    assert (inv.batch_invariant, inv.batch_invariant_chunk_tokens, inv.batch_invariant_max_chunks) == (True, 1024, 512)
    assert "batch_invariant_chunk_tokens=1024" in repr(inv)
    with pytest.raises(TypeError):
        tessera.DecodeConfig(32)  # keywords only


# ---- info, version, packaging --------------------------------------------------------------------

def test_python_m_tessera_info_prints_tessera_info():
    r = run_python(["-m", "tessera", "info"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == tessera.info()
    assert r.stdout.startswith("tessera %s\n" % tessera.__version__)
    assert "kernel path:" in r.stdout
    tool = os.path.join(os.environ.get("TESSERA_BUILD_DIR", ""), "tools", "tessera")
    if not os.path.exists(tool):
        pytest.skip("the tessera command is not built here (TESSERA_BUILD_DIR/tools/tessera)")
    assert subprocess.run([tool, "info"], capture_output=True, text=True).stdout == r.stdout


def test_version_comes_from_cmake_project():
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        version = re.search(r"project\(tessera VERSION ([0-9.]+)", f.read()).group(1)
    assert tessera.__version__ == version
    assert run_python(["-m", "tessera", "version"]).stdout.strip() == version


def test_build_pins_agree_with_pyproject():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        requires = re.search(r"requires = \[(.*?)\]", f.read()).group(1)
    pinned = dict(re.findall(r'"([\w-]+)==([\w.]+)"', requires))
    with open(os.path.join(REPO, "scripts", "requirements-python-build.txt")) as f:
        listed = dict(re.findall(r"^([\w-]+)==([\w.]+)", f.read(), re.M))
    assert pinned and all(listed.get(name) == version for name, version in pinned.items()), (pinned, listed)


def test_stub_and_py_typed_are_shipped_and_cover_the_module():
    here = os.path.dirname(tessera.__file__)
    assert os.path.exists(os.path.join(here, "py.typed"))
    with open(os.path.join(here, "_tessera.pyi")) as f:
        stub = f.read()
    for name in ["batch_prefill", "batch_prefill_paged", "append_paged_kv", "merge_state",
                 "merge_state_in_place", "merge_states", "class BatchDecoder", "class DecodeConfig",
                 "class Error(ValueError)", "def info_text", "def empty"]:
        assert name in stub, name


def test_every_public_name_has_a_docstring():
    for name in tessera.__all__:
        obj = getattr(tessera, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), name
    for method in ["plan", "run", "workspace_bytes"]:
        assert getattr(tessera.BatchDecoder, method).__doc__.strip(), method


def test_torch_is_optional():
    r = run_python(["-c", "import sys; sys.modules['torch'] = None\nimport tessera\n"
                    "assert not tessera.torch_ops_registered; print(tessera.info().splitlines()[0])"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("tessera ")


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_ops_are_registered():
    import torch
    assert tessera.torch_ops_registered
    for op in ["batch_prefill", "batch_prefill_paged", "append_paged_kv", "merge_state",
               "merge_state_in_place", "merge_states", "decode_run"]:
        assert hasattr(torch.ops.tessera, op), op


def test_moe_python_sizes_equal_the_librarys():
    """The sizes the MoE wrappers compute in Python under torch.compile are the library's."""
    from tessera import moe
    rng = np.random.default_rng(3)
    for _ in range(300):
        tokens, top_k = int(rng.integers(0, 5000)), int(rng.integers(1, 9))
        experts = int(rng.integers(top_k, 1025))
        hidden, inter = 8 * int(rng.integers(1, 1000)), 8 * int(rng.integers(1, 1000))
        shared = 8 * int(rng.integers(0, 300))
        assert moe._fused_moe_workspace_bytes_py(tokens, hidden, inter, experts, top_k, shared) == \
            tessera.fused_moe_workspace_bytes(tokens, hidden, inter, experts, top_k, shared)
        assert moe._permute_workspace_bytes_py(tokens, top_k, experts) == \
            _tessera.moe_permute_workspace_bytes(tokens, top_k, experts)
