"""The PyTorch integration that needs no GPU: the torch tensor fast path, the custom ops under
FakeTensorMode, torch.compile(fullgraph=True) tracing the wrappers into tessera ops. Skips where
torch is not installed (it is optional); the GPU results are in test_gpu.py."""
import numpy as np
import pytest

import tessera
from tessera import _tessera

torch = pytest.importorskip("torch")


def test_torch_fast_path_gives_the_dlpack_view():
    for t in [torch.zeros(6, 8, 128, dtype=torch.bfloat16)[:, 2:6], torch.zeros(5, 3, dtype=torch.float32).t(),
              torch.zeros(4, dtype=torch.int32), torch.zeros(2, 3, 64, dtype=torch.float16)[::2]]:
        assert _tessera.view_description(t) == _tessera.view_description(torch.utils.dlpack.to_dlpack(t))


def test_torch_dtype_and_device_errors_name_the_argument():
    with pytest.raises(tessera.Error, match=r"^tessera::x: argument 'y': dtype float64 is not supported"):
        _tessera.tensor_info(torch.zeros(3, dtype=torch.float64), "x", "y")
    with pytest.raises(tessera.Error, match="is on device 'meta'"):
        _tessera.tensor_info(torch.empty(3, dtype=torch.float16, device="meta"), "x", "y")


def test_torch_outputs_are_torch_tensors_and_stay_unwritten_on_error():
    q = torch.randn(8, 4, 128).to(torch.bfloat16)
    out = torch.full_like(q, 7.0)
    idx = torch.tensor([0, 8], dtype=torch.int32)  # CPU tensors: the host copies
    with pytest.raises(tessera.Error, match="argument 'k': must be in device memory"):
        tessera.batch_prefill(q, q, q, idx, idx, out=out)
    assert bool((out == 7.0).all())
    assert isinstance(tessera.merge._alloc_state("merge_state", q, q[:, :, 0].float(), (8, 4, 128), (8, 4), None)[0],
                      torch.Tensor)


def test_ops_under_fake_tensors_give_the_output_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(8, 4, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(8, 2, 128, dtype=torch.bfloat16, device="cuda")
        idx = torch.empty(3, dtype=torch.int32, device="cuda")
        host = torch.empty(3, dtype=torch.int32)
        o, lse = tessera.batch_prefill(q, k, k, idx, idx, host_qo_indptr=host, host_kv_indptr=host, return_lse=True)
        assert (o.shape, o.dtype, str(o.device)) == (q.shape, q.dtype, "cuda:0")
        assert (lse.shape, lse.dtype) == ((8, 4), torch.float32)
        kv_cache = torch.empty(10, 2, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
        paged = tessera.batch_prefill_paged(q, idx, kv_cache, None, idx, idx, idx[:2], host_qo_indptr=host,
                                            host_kv_indptr=host, host_kv_indices=host, host_kv_last_page_len=host[:2])
        assert paged.shape == q.shape
        o_m, s_m = tessera.merge_state(q, lse, q, lse)
        assert (o_m.shape, s_m.shape) == (q.shape, lse.shape)
        o_n = tessera.merge_states(q.view(8, 1, 4, 128), lse.view(8, 1, 4), return_lse=False)
        assert o_n.shape == (8, 4, 128)


def test_torch_compile_fullgraph_traces_the_wrappers_into_tessera_ops():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    def block(q, idx):
        return tessera.batch_prefill(q, q, q, idx, idx, causal=True) * 2

    q = torch.randn(8, 4, 128).to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    # CPU tensors: the traced graph runs the op, whose binding rejects host memory.
    with pytest.raises(tessera.Error, match="argument 'k': must be in device memory"):
        compiled(q, torch.tensor([0, 8], dtype=torch.int32))
    assert len(graphs) == 1 and "tessera.batch_prefill" in graphs[0], graphs


def test_torch_compile_fullgraph_traces_decoder_run():
    from tessera import decode
    # A decoder needs a GPU; tracing run() needs only its Python side: one that was never planned.
    dec = object.__new__(tessera.BatchDecoder)
    dec._kv_indices, dec._captured_indices, dec._handle = None, None, 1 << 40
    decode._DECODERS[dec._handle] = dec
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    q = torch.randn(4, 8, 128).to(torch.bfloat16)
    kv_cache = torch.zeros(3, 2, 16, 2, 128, dtype=torch.bfloat16)
    compiled = torch.compile(lambda q, kv: dec.run(q, kv) + 1, fullgraph=True, backend=backend)
    with pytest.raises(tessera.Error, match=r"run\(\) needs a plan\(\)"):
        compiled(q, kv_cache)
    assert len(graphs) == 1 and "tessera.decode_run" in graphs[0], graphs


def test_eager_calls_skip_the_dispatcher():
    from tessera import _ops
    q = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    assert not _ops.use_torch_op(q)
    assert not _ops.use_torch_op(np.zeros(3))
    assert _ops.use_torch_op(torch.nn.Parameter(q, requires_grad=False))  # subclasses take the op
