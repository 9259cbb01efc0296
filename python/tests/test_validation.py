"""Validation errors surface as tessera.Error with the library's message, naming the entry point,
the argument and the rule, and nothing is written. Runs on CPU-only machines (device tensors are
NumPy memory labelled CUDA, see conftest.py) and against the real kernels on a GPU machine."""
import numpy as np
import pytest

import tessera
from conftest import HAVE_GPU, FakeCudaArray, requires_no_gpu

POISON = 7.0
HEAD_DIM = 128  # compiled in every build (TESSERA_HEAD_DIMS narrows to a subset containing it in CI)


def expect_error(fn, entry, arg, rule_part):
    with pytest.raises(tessera.Error) as e:
        fn()
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert msg.startswith("tessera::%s: argument '%s': " % (entry, arg)), msg
    assert rule_part in msg, msg
    return msg


def expect_gpu_stage(fn):
    """Without a GPU a fully valid call gets through validation and fails at its first GPU step;
    with one it runs."""
    if HAVE_GPU:
        fn()
        return
    with pytest.raises(tessera.Error) as e:
        fn()
    msg = str(e.value)
    assert "argument" not in msg and ("no GPU" in msg or "CUDA" in msg), msg


class Ragged:
    """A small valid ragged prefill problem: 2 requests, qo_len 3 / 5, kv_len 7 / 5, GQA 4 / 2."""

    def __init__(self, dev, dtype="bf16", hq=4, hkv=2, d=HEAD_DIM):
        self.dev = dev
        self.qo = np.array([0, 3, 8], np.int32)
        self.kv = np.array([0, 7, 12], np.int32)
        self.q = dev.randn((8, hq, d), dtype, seed=1)
        self.k = dev.randn((12, hkv, d), dtype, seed=2)
        self.v = dev.randn((12, hkv, d), dtype, seed=3)
        self.o = dev.full((8, hq, d), POISON, dtype)
        self.lse = dev.full((8, hq), POISON, "fp32")

    def call(self, **kw):
        args = dict(q=self.q, k=self.k, v=self.v, qo_indptr=self.dev.indices(self.qo),
                    kv_indptr=self.dev.indices(self.kv), host_qo_indptr=self.qo, host_kv_indptr=self.kv,
                    out=self.o, lse=self.lse)
        args.update(kw)
        return lambda: tessera.batch_prefill(**args)

    def untouched(self):
        assert np.all(self.dev.to_numpy(self.o) == POISON)
        assert np.all(self.dev.to_numpy(self.lse) == POISON)


def test_prefill_valid_arguments_pass_validation(dev):
    p = Ragged(dev)
    expect_gpu_stage(p.call())
    expect_gpu_stage(p.call(causal=True, window_left=2, soft_cap=30.0, scale=0.1))


def test_prefill_dtype_rules(dev):
    p = Ragged(dev)
    expect_error(p.call(q=dev.randn((8, 4, HEAD_DIM), "fp32")), "batch_prefill", "q", "dtype must be bf16 or fp16, got fp32")
    expect_error(p.call(k=dev.randn((12, 2, HEAD_DIM), "fp16")), "batch_prefill", "k", "dtype must be bf16, got fp16")
    expect_error(p.call(q=dev.randn((8, 4, HEAD_DIM), "fp64")), "batch_prefill", "q", "dtype float64 is not supported")
    expect_error(p.call(lse=dev.full((8, 4), 0, "bf16")), "batch_prefill", "lse", "dtype must be fp32")
    p.untouched()


def test_prefill_shape_and_head_rules(dev):
    p = Ragged(dev)
    expect_error(p.call(q=dev.randn((8, 4), "bf16")), "batch_prefill", "q", "must have rank 3")
    expect_error(p.call(k=dev.randn((12, 2, 64), "bf16"), v=dev.randn((12, 2, 64), "bf16")),
                 "batch_prefill", "k", "head_dim 64 must equal q's head_dim %d" % HEAD_DIM)
    expect_error(p.call(k=dev.randn((12, 3, HEAD_DIM), "bf16"), v=dev.randn((12, 3, HEAD_DIM), "bf16")),
                 "batch_prefill", "num_qo_heads", "must be a multiple of num_kv_heads")
    expect_error(p.call(v=dev.randn((11, 2, HEAD_DIM), "bf16")), "batch_prefill", "v", "must equal the shape of 'k'")
    expect_error(p.call(lse=dev.full((8, 3), 0, "fp32")), "batch_prefill", "lse", "must be [total_q, num_qo_heads]")
    p.untouched()


def test_prefill_stride_rules(dev):
    p = Ragged(dev)
    wide = dev.randn((8, 4, 2 * HEAD_DIM), "bf16")
    expect_error(p.call(q=wide[:, :, ::2]), "batch_prefill", "q", "the last dim (head_dim) must be contiguous")
    odd = dev.randn((8, 4, HEAD_DIM + 4), "bf16")
    expect_error(p.call(q=odd[:, :, :HEAD_DIM]), "batch_prefill", "q", "must be a multiple of 16 bytes")
    expect_error(p.call(out=p.q), "batch_prefill", "o", "must not overlap 'q'")
    p.untouched()


def test_prefill_strided_packed_qkv_is_accepted(dev):
    # q, k and v as slices of one packed [tokens, (hq + 2 * hkv) * d] projection output
    hq, hkv, d, tokens = 4, 2, HEAD_DIM, 8
    qkv = dev.randn((tokens, (hq + 2 * hkv), d), "bf16", seed=9)
    p = Ragged(dev)
    qo = np.array([0, 3, 8], np.int32)
    call = p.call(q=qkv[:, :hq], k=qkv[:, hq:hq + hkv], v=qkv[:, hq + hkv:], qo_indptr=dev.indices(qo),
                  kv_indptr=dev.indices(qo), host_qo_indptr=qo, host_kv_indptr=qo)
    expect_gpu_stage(call)


def test_prefill_index_rules(dev):
    p = Ragged(dev)
    bad = np.array([0, 5, 3], np.int32)
    expect_error(p.call(qo_indptr=dev.indices(bad), host_qo_indptr=bad), "batch_prefill", "qo_indptr",
                 "must be non-decreasing, but entry 2 (3) < entry 1 (5)")
    start = np.array([1, 3, 8], np.int32)
    expect_error(p.call(qo_indptr=dev.indices(start), host_qo_indptr=start), "batch_prefill", "qo_indptr",
                 "must start at 0")
    past = np.array([0, 7, 13], np.int32)
    expect_error(p.call(kv_indptr=dev.indices(past), host_kv_indptr=past), "batch_prefill", "kv_indptr",
                 "last entry 13 exceeds 12")
    expect_error(p.call(kv_indptr=dev.tensor(p.kv.astype(np.int64), "int64")), "batch_prefill", "kv_indptr",
                 "dtype int64 is not supported")
    expect_error(p.call(host_qo_indptr=p.qo.astype(np.int64)), "batch_prefill", "host_qo_indptr",
                 "dtype int64 is not supported")
    expect_error(p.call(host_qo_indptr=np.array([0, 3], np.int32)), "batch_prefill", "host_qo_indptr",
                 "has 2 entries but its device array has 3")
    expect_error(p.call(host_qo_indptr=np.array([0, 0, 3, 0, 8, 0], np.int32)[::2]), "batch_prefill",
                 "host_qo_indptr", "must be contiguous")
    expect_error(p.call(host_qo_indptr=p.q), "batch_prefill", "host_qo_indptr", "must be in host memory")
    expect_error(p.call(qo_indptr=p.qo, host_qo_indptr=p.qo), "batch_prefill", "host_qo_indptr",
                 "'qo_indptr' is on the host too")
    p.untouched()


def test_prefill_variant_and_path_rules(dev):
    p = Ragged(dev)
    expect_error(p.call(window_left=-2), "batch_prefill", "window_left", "must be -1 (no window) or >= 0")
    expect_error(p.call(soft_cap=-1.0), "batch_prefill", "soft_cap", "must be finite and >= 0")
    expect_error(p.call(scale=float("nan")), "batch_prefill", "scale", "must be finite and >= 0")
    expect_error(p.call(path="fastest"), "batch_prefill", "path", "must be 'auto', 'portable' or 'hopper'")
    p.untouched()


def test_host_memory_tensor_is_rejected_by_device(dev):
    p = Ragged(dev)
    host_q = np.zeros((8, 4, HEAD_DIM), np.float16)  # NumPy through DLPack: CPU memory
    expect_error(p.call(q=host_q, k=dev.randn((12, 2, HEAD_DIM), "fp16"), v=dev.randn((12, 2, HEAD_DIM), "fp16"),
                        out=dev.full((8, 4, HEAD_DIM), POISON, "fp16")),
                 "batch_prefill", "q", "must be in device memory")
    p.untouched()


class Paged:
    """A valid paged problem: page_size 4, 6 pages, requests of 7 and 5 tokens."""

    def __init__(self, dev, layout="NHD", combined=False, dtype="bf16", hq=4, hkv=2, d=HEAD_DIM):
        self.dev, self.layout = dev, layout
        self.page_size, self.num_pages = 4, 6
        shape = (self.num_pages, self.page_size, hkv, d) if layout == "NHD" else (self.num_pages, hkv, self.page_size, d)
        if combined:
            self.kv = dev.randn((self.num_pages, 2) + shape[1:], dtype, seed=4)
            self.k_pages, self.v_pages = self.kv, None
        else:
            self.k_pages, self.v_pages = dev.randn(shape, dtype, seed=4), dev.randn(shape, dtype, seed=5)
        self.indptr = np.array([0, 2, 4], np.int32)
        self.indices = np.array([5, 0, 3, 1], np.int32)
        self.last = np.array([3, 1], np.int32)
        self.qo = np.array([0, 3, 8], np.int32)
        self.q = dev.randn((8, hq, d), dtype, seed=6)
        self.o = dev.full((8, hq, d), POISON, dtype)

    def table(self, **kw):
        t = dict(kv_indptr=self.dev.indices(self.indptr), kv_indices=self.dev.indices(self.indices),
                 kv_last_page_len=self.dev.indices(self.last), host_kv_indptr=self.indptr,
                 host_kv_indices=self.indices, host_kv_last_page_len=self.last)
        t.update(kw)
        return t

    # The new rows of append(): 2 into request 0, 1 into request 1.
    append_rows = np.array([0, 2, 3], np.int32)

    def append(self, **kw):
        args = dict(k_pages=self.k_pages, v_pages=self.v_pages, append_indptr=self.dev.indices(self.append_rows),
                    host_append_indptr=self.append_rows, k_new=self.dev.randn((3, 2, HEAD_DIM), "bf16", seed=7),
                    v_new=self.dev.randn((3, 2, HEAD_DIM), "bf16", seed=8), layout=self.layout)
        args.update(self.table(**{k: v for k, v in kw.items() if "kv_" in k}))
        args.update({k: v for k, v in kw.items() if "kv_" not in k})
        return lambda: tessera.append_paged_kv(**args)

    def prefill(self, **kw):
        args = dict(q=self.q, qo_indptr=self.dev.indices(self.qo), host_qo_indptr=self.qo,
                    k_pages=self.k_pages, v_pages=self.v_pages, layout=self.layout, out=self.o)
        args.update(self.table(**{k: v for k, v in kw.items() if "kv_" in k}))
        args.update({k: v for k, v in kw.items() if "kv_" not in k})
        return lambda: tessera.batch_prefill_paged(**args)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
def test_paged_prefill_valid_layouts(dev, layout, combined):
    p = Paged(dev, layout, combined)
    expect_gpu_stage(p.prefill())


def test_paged_prefill_page_table_rules(dev):
    p = Paged(dev)
    bad = np.array([5, 0, 3, 6], np.int32)
    expect_error(p.prefill(kv_indices=dev.indices(bad), host_kv_indices=bad), "batch_prefill_paged",
                 "kv_indices", "page id 6 at index 3 is outside the cache's 6 pages")
    last = np.array([3, 5], np.int32)
    expect_error(p.prefill(kv_last_page_len=dev.indices(last), host_kv_last_page_len=last),
                 "batch_prefill_paged", "kv_last_page_len", "value 5 at index 1 is outside 1..4")
    indptr = np.array([0, 3, 2], np.int32)
    expect_error(p.prefill(kv_indptr=dev.indices(indptr), host_kv_indptr=indptr), "batch_prefill_paged",
                 "kv_indptr", "must be non-decreasing")
    expect_error(p.prefill(layout="NDH"), "batch_prefill_paged", "layout", "must be 'NHD' or 'HND'")
    assert np.all(dev.to_numpy(p.o) == POISON)


def test_combined_cache_shape_rule(dev):
    p = Paged(dev)
    three = dev.randn((6, 3, 4, 2, HEAD_DIM), "bf16")
    expect_error(p.prefill(k_pages=three, v_pages=None), "batch_prefill_paged", "kv_cache",
                 "a combined cache (v_pages None) must be [num_pages, 2, page_size")
    assert np.all(dev.to_numpy(p.o) == POISON)


def test_append_rules(dev):
    p = Paged(dev)
    new_rows = np.array([0, 2, 3], np.int32)  # 2 rows into request 0, 1 into request 1
    k_new, v_new = dev.randn((3, 2, HEAD_DIM), "bf16", seed=7), dev.randn((3, 2, HEAD_DIM), "bf16", seed=8)
    before = dev.to_numpy(p.k_pages).copy()

    def append(**kw):
        args = dict(k_pages=p.k_pages, v_pages=p.v_pages, append_indptr=dev.indices(new_rows),
                    host_append_indptr=new_rows, k_new=k_new, v_new=v_new, layout="NHD")
        args.update(p.table(**{k: v for k, v in kw.items() if "kv_" in k}))
        args.update({k: v for k, v in kw.items() if "kv_" not in k})
        return lambda: tessera.append_paged_kv(**args)

    expect_gpu_stage(append())
    too_many = np.array([0, 8, 9], np.int32)
    expect_error(append(append_indptr=dev.indices(too_many), host_append_indptr=too_many,
                        k_new=dev.randn((9, 2, HEAD_DIM), "bf16"), v_new=dev.randn((9, 2, HEAD_DIM), "bf16")),
                 "append_paged_kv", "append_indptr", "request 0 appends 8 rows but its pages hold only 7 tokens")
    same_page = np.array([5, 0, 3, 0], np.int32)  # both requests append into page 0
    expect_error(append(kv_indices=dev.indices(same_page), host_kv_indices=same_page), "append_paged_kv",
                 "kv_indices", "receives new rows twice")
    expect_error(append(k_new=dev.randn((3, 2, 64), "bf16")), "append_paged_kv", "k_new",
                 "dim 2 must equal head_dim of the cache")
    if not HAVE_GPU:
        assert np.array_equal(dev.to_numpy(p.k_pages), before)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_takes_the_combined_cache(dev, layout):
    """K and V interleaved in one [num_pages, 2, ...] tensor (vLLM's and FlashInfer's layout): the
    two halves share a buffer but no element, so append accepts them as prefill and decode do."""
    p = Paged(dev, layout, combined=True)
    new_rows = np.array([0, 2, 3], np.int32)
    k_new, v_new = dev.randn((3, 2, HEAD_DIM), "bf16", seed=7), dev.randn((3, 2, HEAD_DIM), "bf16", seed=8)
    expect_gpu_stage(lambda: tessera.append_paged_kv(p.kv, None, append_indptr=dev.indices(new_rows),
                                                     host_append_indptr=new_rows, k_new=k_new, v_new=v_new,
                                                     layout=layout, **p.table()))
    # Two views of the same halves one page apart do share elements: refused, nothing written.
    before = dev.to_numpy(p.kv).copy()
    k_view, v_view = p.kv[1:, 0], p.kv[:-1, 0]
    expect_error(lambda: tessera.append_paged_kv(k_view, v_view, append_indptr=dev.indices(new_rows),
                                                 host_append_indptr=new_rows, k_new=k_new, v_new=v_new,
                                                 layout=layout, **p.table()),
                 "append_paged_kv", "v_pages", "must not overlap 'k_pages'")
    assert np.array_equal(dev.to_numpy(p.kv), before)


def test_merge_rules(dev):
    o_a, o_b = dev.randn((5, 3, 64), "bf16", seed=1), dev.randn((5, 3, 64), "bf16", seed=2)
    s_a, s_b = dev.randn((5, 3), "fp32", seed=3), dev.randn((5, 3), "fp32", seed=4)
    out, s_out = dev.full((5, 3, 64), POISON, "bf16"), dev.full((5, 3), POISON, "fp32")
    expect_gpu_stage(lambda: tessera.merge_state(o_a, s_a, o_b, s_b, out=out, s_out=s_out))
    expect_error(lambda: tessera.merge_state(o_a, dev.randn((5, 3), "bf16"), o_b, s_b, out=out, s_out=s_out),
                 "merge_state", "s_a", "dtype must be fp32")
    expect_error(lambda: tessera.merge_state(o_a, s_a, o_b, dev.randn((5, 4), "fp32"), out=out, s_out=s_out),
                 "merge_state", "s_b", "must equal the leading dims of 'o_b'")
    o24 = dev.randn((5, 3, 24), "bf16")
    expect_error(lambda: tessera.merge_state(o24, s_a, o24, s_b, out=dev.full((5, 3, 24), 0, "bf16"), s_out=s_out),
                 "merge_state", "o_a", "head_dim must be one of 8, 16, 32, 64, 128, 256")
    expect_error(lambda: tessera.merge_state(o_a, s_a, o_b, s_b, out=o_a, s_out=s_out), "merge_state",
                 "o_out", "must not overlap 'o_a'")
    expect_error(lambda: tessera.merge_state_in_place(o_a, s_a, o_b, dev.randn((5, 3, 1), "fp32")),
                 "merge_state_in_place", "s_other", "must have rank 2")
    parts, s_parts = dev.randn((5, 4, 3, 64), "fp32"), dev.randn((5, 4, 3), "fp32")
    expect_gpu_stage(lambda: tessera.merge_states(parts, s_parts, out=out, s_out=s_out))
    expect_error(lambda: tessera.merge_states(parts, s_parts, out=dev.full((5, 3, 64), 0, "fp32")[:, :2], s_out=s_out),
                 "merge_states", "o_out", "must be [rows, heads, head_dim]")
    if not HAVE_GPU:
        assert np.all(dev.to_numpy(out) == POISON) and np.all(dev.to_numpy(s_out) == POISON)


@pytest.mark.parametrize("field,value,rule", [
    ("num_kv_heads", 3, "must be a multiple of num_kv_heads"),
    ("head_dim", 96, "must be one of the compiled head dims"),
    ("page_size", 0, "must be in 1..256, got 0"),
    ("max_batch_size", 0, "must be >= 1, got 0"),
    ("max_qo_len", 9, "must be in 1..8, got 9"),
    ("window_left", -5, "must be -1 (no window) or >= 0"),
    ("pipeline_stages", 4, "must be 0 (automatic), 2 or 3"),
])
def test_decoder_config_rules(field, value, rule):
    cfg = dict(num_qo_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, max_batch_size=4)
    cfg[field] = value
    arg = "num_qo_heads" if field == "num_kv_heads" else field
    expect_error(lambda: tessera.BatchDecoder(tessera.DecodeConfig(**cfg)), "BatchDecoder::workspace_bytes", arg, rule)


def test_decoder_config_group_limit():
    cfg = tessera.DecodeConfig(num_qo_heads=34, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, max_batch_size=4)
    expect_error(lambda: tessera.BatchDecoder(cfg), "BatchDecoder::workspace_bytes", "num_qo_heads",
                 "the GQA group num_qo_heads / num_kv_heads = 17 exceeds 16")


@requires_no_gpu
def test_decoder_without_gpu_says_so():
    cfg = tessera.DecodeConfig(num_qo_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, max_batch_size=4)
    with pytest.raises(tessera.Error, match="CUDA"):
        tessera.BatchDecoder(cfg)


# ---- The validation table through the package: entry point x tensor argument x rule ----------------
# Each case breaks one rule of one argument of a valid call (a dtype the rule refuses, one more
# dim) and expects tessera.Error naming the C++ entry point and argument; outputs stay untouched.
def _merge_problem(dev):
    return dict(o_a=dev.randn((5, 3, 64), "bf16", seed=1), s_a=dev.randn((5, 3), "fp32", seed=3),
                o_b=dev.randn((5, 3, 64), "bf16", seed=2), s_b=dev.randn((5, 3), "fp32", seed=4),
                out=dev.full((5, 3, 64), POISON, "bf16"), s_out=dev.full((5, 3), POISON, "fp32"),
                o_parts=dev.randn((5, 4, 3, 64), "fp32", seed=5), s_parts=dev.randn((5, 4, 3), "fp32", seed=6))


_TABLE = [  # (entry, the package call from a problem dict, [(python argument, the library's name)])
    ("merge_state", lambda t: tessera.merge_state(t["o_a"], t["s_a"], t["o_b"], t["s_b"], out=t["out"], s_out=t["s_out"]),
     [("o_a", "o_a"), ("s_a", "s_a"), ("o_b", "o_b"), ("s_b", "s_b"), ("out", "o_out"), ("s_out", "s_out")]),
    ("merge_state_in_place", lambda t: tessera.merge_state_in_place(t["out"], t["s_out"], t["o_b"], t["s_b"]),
     [("out", "o"), ("s_out", "s"), ("o_b", "o_other"), ("s_b", "s_other")]),
    ("merge_states", lambda t: tessera.merge_states(t["o_parts"], t["s_parts"], out=t["out"], s_out=t["s_out"]),
     [("o_parts", "o_parts"), ("s_parts", "s_parts"), ("out", "o_out"), ("s_out", "s_out")]),
]


def _broken(dev, x, rule):
    """x with one rule broken: its dtype swapped for one the rule refuses, or one more dim."""
    shape = tuple(x.shape)
    if rule == "dtype":
        floating = dev.to_numpy(x).dtype.kind == "f"
        return dev.randn(shape, "int32" if floating else "fp32") if floating else dev.randn(shape, "fp32")
    return dev.randn(shape + (1,), "fp32")


@pytest.mark.parametrize("entry,call,args", _TABLE, ids=[t[0] for t in _TABLE])
@pytest.mark.parametrize("rule", ["dtype", "rank"])
def test_validation_table(dev, entry, call, args, rule):
    for python_name, library_name in args:
        t = _merge_problem(dev)
        out_before, s_before = dev.to_numpy(t["out"]).copy(), dev.to_numpy(t["s_out"]).copy()
        t[python_name] = _broken(dev, t[python_name], rule)
        with pytest.raises(tessera.Error) as e:
            call(t)
        assert ("tessera::%s: argument '%s'" % (entry, library_name)) in str(e.value), (python_name, str(e.value))
        if python_name not in ("out", "s_out"):
            assert np.array_equal(dev.to_numpy(t["out"]), out_before)
            assert np.array_equal(dev.to_numpy(t["s_out"]), s_before)


# The prefill and append wrappers in the same table: each device tensor argument x {dtype, rank},
# by keyword.
_PREFILL_TABLE = [
    ("batch_prefill", lambda dev, **kw: Ragged(dev).call(**kw),
     [("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"), ("lse", "lse"), ("qo_indptr", "qo_indptr"),
      ("kv_indptr", "kv_indptr")]),
    ("batch_prefill_paged", lambda dev, **kw: Paged(dev).prefill(**kw),
     [("q", "q"), ("out", "o"), ("k_pages", "k_pages"), ("v_pages", "v_pages"), ("qo_indptr", "qo_indptr"),
      ("kv_indptr", "kv_indptr"), ("kv_indices", "kv_indices"), ("kv_last_page_len", "kv_last_page_len")]),
    ("append_paged_kv", lambda dev, **kw: Paged(dev).append(**kw),
     [("k_pages", "k_pages"), ("v_pages", "v_pages"), ("k_new", "k_new"), ("v_new", "v_new"),
      ("append_indptr", "append_indptr"), ("kv_indptr", "kv_indptr"), ("kv_indices", "kv_indices"),
      ("kv_last_page_len", "kv_last_page_len")]),
]


def _valid_argument(dev, entry, name):
    """The argument `name` of the table's valid problem for `entry` (to break it)."""
    if entry == "batch_prefill":
        p = Ragged(dev)
        return {"q": p.q, "k": p.k, "v": p.v, "out": p.o, "lse": p.lse, "qo_indptr": dev.indices(p.qo),
                "kv_indptr": dev.indices(p.kv)}[name]
    p = Paged(dev)
    return {"q": p.q, "out": p.o, "k_pages": p.k_pages, "v_pages": p.v_pages, "qo_indptr": dev.indices(p.qo),
            "kv_indptr": dev.indices(p.indptr), "kv_indices": dev.indices(p.indices),
            "kv_last_page_len": dev.indices(p.last), "append_indptr": dev.indices(p.append_rows),
            "k_new": dev.randn((3, 2, HEAD_DIM), "bf16", seed=7), "v_new": dev.randn((3, 2, HEAD_DIM), "bf16", seed=8)}[name]


@pytest.mark.parametrize("entry,make,args", _PREFILL_TABLE, ids=[t[0] for t in _PREFILL_TABLE])
@pytest.mark.parametrize("rule", ["dtype", "rank"])
def test_prefill_validation_table(dev, entry, make, args, rule):
    for python_name, library_name in args:
        broken = _broken(dev, _valid_argument(dev, entry, python_name), rule)
        with pytest.raises(tessera.Error) as e:
            make(dev, **{python_name: broken})()
        msg = str(e.value)
        assert ("tessera::%s: argument '%s'" % (entry, library_name)) in msg, (python_name, msg)


def test_moe_route_rules(dev):
    logits = dev.randn((6, 16), "fp32", seed=5)
    ids, w = dev.full((6, 4), -7, "int32"), dev.full((6, 4), POISON, "fp32")
    expect_gpu_stage(lambda: tessera.moe_route(logits, 4, topk_ids=ids, topk_weights=w))
    expect_error(lambda: tessera.moe_route(logits, 17, topk_ids=dev.full((6, 17), 0, "int32"),
                                           topk_weights=dev.full((6, 17), 0, "fp32")),
                 "moe_route", "top_k", "must be in 1..min(num_experts, 32)")
    expect_error(lambda: tessera.moe_route(logits, 4, num_groups=3, topk_ids=ids, topk_weights=w),
                 "moe_route", "num_groups", "must divide num_experts")
    expect_error(lambda: tessera.moe_route(logits, 4, selection_bias=dev.randn((15,), "fp32"), topk_ids=ids,
                                           topk_weights=w),
                 "moe_route", "selection_bias", "")
    expect_error(lambda: tessera.moe_route(logits, 4, topk_ids=dev.full((6, 4), 0, "fp32"), topk_weights=w),
                 "moe_route", "topk_ids", "dtype")
    expect_error(lambda: tessera.moe_route(logits, 4, score="relu"), "moe_route", "score", "'softmax' or 'sigmoid'")
    if not HAVE_GPU:
        assert np.all(dev.to_numpy(ids) == -7) and np.all(dev.to_numpy(w) == POISON)


def test_moe_permute_rules(dev):
    ids = dev.indices(np.array([[1, 0], [3, 3], [2, -1]], np.int32))
    cap = tessera.moe_permute_capacity(3, 2, 4, 8)
    assert cap == 3 * 2 + 4 * 7
    outs = dict(expert_offsets=dev.full((5,), -7, "int32"), permuted_token=dev.full((cap,), -7, "int32"),
                inverse=dev.full((3, 2), -7, "int32"), workspace=dev.full((256,), 0, "int32"))
    expect_gpu_stage(lambda: tessera.moe_permute(ids, 4, align=8, **outs))
    expect_error(lambda: tessera.moe_permute(ids, 4, align=0, **outs), "moe_permute_capacity", "align", "1..1024")
    expect_error(lambda: tessera.moe_permute(ids, 4, align=8, **dict(outs, permuted_token=dev.full((5,), 0, "int32"))),
                 "moe_permute", "permuted_token", "moe_permute_capacity")
    expect_error(lambda: tessera.moe_permute(ids, 4, align=8, x=dev.randn((3, 64), "fp32"),
                                             permuted_x=dev.full((cap, 64), 0, "fp32"), **outs),
                 "moe_permute", "x", "dtype")
    expect_error(lambda: tessera.moe_permute(ids, 4, align=8, **dict(outs, workspace=dev.full((2,), 0, "int32"))),
                 "moe_permute", "workspace_size", "moe_permute_workspace_bytes")
    expect_error(lambda: tessera.moe_permute(dev.full((3, 2), 0, "fp32"), 4, align=8, **outs),
                 "moe_permute", "topk_ids", "dtype")
    if not HAVE_GPU:
        assert np.all(dev.to_numpy(outs["inverse"]) == -7) and np.all(dev.to_numpy(outs["permuted_token"]) == -7)


def test_moe_grouped_gemm_rules(dev):
    a = dev.randn((10, 72), "bf16", seed=6)
    w = dev.randn((4, 32, 72), "bf16", seed=7)
    offsets = dev.indices(np.array([0, 3, 3, 8, 10], np.int32))
    out = dev.full((10, 32), POISON, "bf16")
    expect_gpu_stage(lambda: tessera.moe_grouped_gemm(a, w, offsets, out=out))
    expect_gpu_stage(lambda: tessera.moe_grouped_gemm(a, w, offsets, activation="swiglu",
                                                      out=dev.full((10, 16), POISON, "bf16")))
    expect_error(lambda: tessera.moe_grouped_gemm(a, w, offsets, activation="swiglu", out=out),
                 "moe_grouped_gemm", "out", "N / 2 (SwiGLU)")
    expect_error(lambda: tessera.moe_grouped_gemm(a, w, offsets, activation="gelu"), "moe_grouped_gemm", "activation",
                 "'swiglu'")
    expect_error(lambda: tessera.moe_grouped_gemm(a, dev.randn((4, 32, 72), "fp16", seed=8), offsets, out=out),
                 "moe_grouped_gemm", "weights", "dtype")
    expect_error(lambda: tessera.moe_grouped_gemm(a, w, dev.indices(np.array([0, 3, 10], np.int32)), out=out),
                 "moe_grouped_gemm", "expert_offsets", "num_experts + 1")
    expect_error(lambda: tessera.moe_grouped_gemm(dev.randn((10, 68), "bf16", seed=9), dev.randn((4, 32, 68), "bf16"),
                                                  offsets, out=out),
                 "moe_grouped_gemm", "a", "multiple of 8")
    if not HAVE_GPU:
        assert np.all(dev.to_numpy(out) == POISON)


def test_moe_grouped_gemm_gathered_rows_rules(dev):
    # a_rows [10]: product row r reads x[a_rows[r]]; x has any number of rows (here 6 and 40),
    # entries outside them (-1, 6) read zeros. int32, 1-D, contiguous; as many as out's rows.
    x = dev.randn((6, 72), "bf16", seed=15)
    w = dev.randn((4, 32, 72), "bf16", seed=7)
    offsets = dev.indices(np.array([0, 3, 3, 8, 10], np.int32))
    a_rows = dev.indices(np.array([0, 5, -1, 2, 2, 6, 1, 3, 4, 0], np.int32))
    out = dev.full((10, 32), POISON, "bf16")
    expect_gpu_stage(lambda: tessera.moe_grouped_gemm(x, w, offsets, out=out, a_rows=a_rows))
    expect_gpu_stage(lambda: tessera.moe_grouped_gemm(dev.randn((40, 72), "bf16", seed=16), w, offsets, out=out,
                                                      a_rows=a_rows))
    expect_gpu_stage(lambda: tessera.moe_grouped_gemm(x, w, offsets, activation="swiglu", a_rows=a_rows,
                                                      out=dev.full((10, 16), POISON, "bf16")))

    def call(**kw):
        args = dict(out=out, a_rows=a_rows)
        args.update(kw)
        return lambda: tessera.moe_grouped_gemm(x, w, offsets, **args)

    expect_error(call(a_rows=dev.full((10,), 0, "fp32")), "moe_grouped_gemm", "a_rows", "dtype")
    expect_error(call(a_rows=dev.indices(np.zeros((10, 1), np.int32))), "moe_grouped_gemm", "a_rows", "rank")
    expect_error(call(a_rows=dev.indices(np.zeros(20, np.int32))[::2]), "moe_grouped_gemm", "a_rows", "stride")
    expect_error(call(a_rows=dev.indices(np.zeros(9, np.int32))), "moe_grouped_gemm", "out", "a_rows")
    expect_error(call(a_rows=dev.indices(np.zeros(11, np.int32))), "moe_grouped_gemm", "out", "a_rows")
    # out apart from a_rows: an int32 view of out's first 40 bytes.
    if dev.real:
        import torch
        alias = out.view(torch.int32).reshape(-1)[:10]
    else:
        alias = FakeCudaArray(out.host.view(np.int32).reshape(-1)[:10], "int32")
    expect_error(call(a_rows=alias), "moe_grouped_gemm", "out", "must not overlap 'a_rows'")
    # Without a_rows, x's 6 rows are not out's 10.
    expect_error(call(a_rows=None), "moe_grouped_gemm", "out", "")
    if not HAVE_GPU:
        assert np.all(dev.to_numpy(out) == POISON)


def test_moe_combine_and_fused_moe_rules(dev):
    y = dev.randn((12, 64), "bf16", seed=10)
    inverse = dev.indices(np.arange(12, dtype=np.int32).reshape(6, 2))
    weights = dev.full((6, 2), 0.5, "fp32")
    out = dev.full((6, 64), POISON, "bf16")
    expect_gpu_stage(lambda: tessera.moe_combine(y, inverse, weights, out=out))
    expect_error(lambda: tessera.moe_combine(y, inverse, dev.full((6, 3), 0.5, "fp32"), out=out),
                 "moe_combine", "topk_weights", "")
    expect_error(lambda: tessera.moe_combine(y, inverse, weights, shared_out=dev.full((6, 56), 0, "bf16"), out=out),
                 "moe_combine", "shared_out", "shape")
    x = dev.randn((6, 64), "bf16", seed=11)
    w1, w2 = dev.randn((4, 64, 64), "bf16", seed=12), dev.randn((4, 64, 32), "bf16", seed=13)
    logits = dev.randn((6, 4), "fp32", seed=14)
    fused_out = dev.full((6, 64), POISON, "bf16")
    ws = dev.full(((tessera.fused_moe_workspace_bytes(6, 64, 32, 4, 2) + 3) // 4,), 0, "int32")
    expect_gpu_stage(lambda: tessera.fused_moe(x, w1, w2, logits, top_k=2, out=fused_out, workspace=ws))
    # Without a workspace the wrapper sizes one first: the sizing function reports the rule.
    expect_error(lambda: tessera.fused_moe(x, w1, w2, logits, top_k=5, out=fused_out), "fused_moe_workspace_bytes",
                 "top_k", "")
    expect_error(lambda: tessera.fused_moe(x, w1, dev.randn((4, 64, 40), "bf16"), logits, top_k=2, out=fused_out,
                                           workspace=ws),
                 "fused_moe", "w2", "inter")
    expect_error(lambda: tessera.fused_moe(x, w1, w2, dev.randn((6, 5), "fp32"), top_k=2, out=fused_out, workspace=ws),
                 "fused_moe", "router_logits", "num_experts")
    expect_error(lambda: tessera.fused_moe(x, w1, w2, top_k=2, out=fused_out, workspace=ws), "fused_moe",
                 "router_logits", "topk_ids and topk_weights")
    expect_error(lambda: tessera.fused_moe(x, w1, w2, logits, top_k=2, out=fused_out,
                                           workspace=dev.full((4,), 0, "int32")),
                 "fused_moe", "workspace_size", "fused_moe_workspace_bytes")
    if not HAVE_GPU:
        assert np.all(dev.to_numpy(out) == POISON) and np.all(dev.to_numpy(fused_out) == POISON)


@pytest.mark.skipif(not HAVE_GPU, reason="runs the MoE kernels: needs a GPU")
def test_moe_route_and_permute_match_numpy(dev):
    rng = np.random.default_rng(11)
    tokens, experts, k = 37, 16, 2
    logits = np.stack([rng.permutation(experts) for _ in range(tokens)]).astype(np.float32) * 0.25
    ids, w = tessera.moe_route(dev.tensor(logits, "fp32"), k, renormalize=True)
    ids, w = dev.to_numpy(ids), dev.to_numpy(w)
    want_ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    assert np.array_equal(ids, want_ids)
    e = np.exp(logits - logits.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    chosen = np.take_along_axis(p, want_ids, 1)
    assert np.allclose(w, chosen / chosen.sum(1, keepdims=True), atol=1e-6)
    x = rng.standard_normal((tokens, 64)).astype(np.float32)
    perm = tessera.moe_permute(dev.indices(want_ids.astype(np.int32)), experts, align=4, x=dev.tensor(x, "bf16"))
    offsets, tok, inv = dev.to_numpy(perm.expert_offsets), dev.to_numpy(perm.permuted_token), dev.to_numpy(perm.inverse)
    counts = np.bincount(want_ids.ravel(), minlength=experts)
    assert np.array_equal(np.diff(offsets), (counts + 3) // 4 * 4)
    flat = want_ids.ravel()
    for i, row in enumerate(inv.ravel()):
        assert offsets[flat[i]] <= row < offsets[flat[i] + 1] and tok[row] == i // k
    px = dev.to_numpy(perm.permuted_x)
    xb = dev.to_numpy(dev.tensor(x, "bf16"))
    for row in range(offsets[-1]):
        assert np.array_equal(px[row], xb[tok[row]] if tok[row] >= 0 else np.zeros(64))


def test_batch_prefill_paged_config_rules():
    cfg = tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256)
    assert cfg.max_kv_splits == 16 and cfg.path == tessera.AttentionPath.AUTO
    assert cfg.causal is False and cfg.window_left == -1
    assert tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256,
                                      causal=True, window_left=512).window_left == 512
    assert tessera.paged_prefill_workspace_bytes(cfg) == 16 * 256 * 8 * (HEAD_DIM + 1) * 4
    for field, value, rule in [("num_qo_heads", 0, "must be >= 1"), ("page_size", 0, "must be >= 1"),
                               ("max_kv_splits", 0, "must be in 1..256"), ("max_q_rows", 0, "must be >= 1"),
                               ("window_left", -2, "must be >= -1")]:
        bad = tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256)
        setattr(bad, field, value)
        expect_error(lambda: tessera.paged_prefill_workspace_bytes(bad), "BatchPrefillPaged::workspace_bytes",
                     field, rule)


def test_batch_prefill_paged_cuda_graph_config():
    cfg = tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256,
                                     cuda_graph=True, max_batch_size=4)
    assert cfg.cuda_graph is True and cfg.max_batch_size == 4
    plain = tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256)
    # The step's image (header and index arrays) after the partials.
    assert tessera.paged_prefill_workspace_bytes(cfg) > tessera.paged_prefill_workspace_bytes(plain)
    cfg.max_batch_size = 0
    expect_error(lambda: tessera.paged_prefill_workspace_bytes(cfg), "BatchPrefillPaged::workspace_bytes",
                 "max_batch_size", "with cuda_graph")
    # Without cuda_graph, max_batch_size sizes the same image (the fixed grid in eager mode).
    eager = tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256,
                                       max_batch_size=4)
    assert tessera.paged_prefill_workspace_bytes(eager) == tessera.paged_prefill_workspace_bytes(
        tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256,
                                   cuda_graph=True, max_batch_size=4))
    invariant = tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256,
                                           batch_invariant=True)
    assert invariant.batch_invariant is True and plain.batch_invariant is False


@requires_no_gpu
def test_batch_prefill_paged_without_gpu_says_so():
    cfg = tessera.PagedPrefillConfig(num_qo_heads=8, head_dim=HEAD_DIM, page_size=16, max_q_rows=256)
    with pytest.raises(tessera.Error) as e:
        tessera.BatchPrefillPaged(cfg)
    assert "CUDA" in str(e.value) or "GPU" in str(e.value), str(e.value)
