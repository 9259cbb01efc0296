"""fp64 CPU references (NumPy) for the GPU tests, and the naive low-precision computation that sets
the tolerance (docs/CONVENTIONS.md: a kernel's max error against fp64 is at most 2x the max error
of the same computation done naively in the kernel's precision, plus a small floor). The same
algorithm as src/reference/attention_ref.cpp (attention_naive_lowp): scores in fp32, P and the
output rounded to the storage precision."""
import numpy as np

MANTISSA_BITS = {"bf16": 7, "fp16": 10}


def round_mantissa(x, bits):
    """x (float32) rounded to `bits` mantissa bits, ties to even (bf16: 7, fp16: 10)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    lsb = (u >> drop) & 1
    u = (u + ((1 << (drop - 1)) - 1) + lsb) & ~np.uint64((1 << drop) - 1)
    out = u.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, x)


def attention(q, k, v, qo_indptr, kv_indptr, causal=False, window_left=-1, scale=None, soft_cap=0.0,
              lowp=None):
    """Ragged attention. q [total_q, hq, d], k / v [total_kv, hkv, d] as float arrays. Returns
    (o [total_q, hq, d], lse [total_q, hq]) in float64; lowp 'bf16' / 'fp16' computes naively in
    that precision instead (fp32 math, P and o rounded)."""
    ftype = np.float32 if lowp else np.float64
    q, k, v = (np.asarray(x, ftype) for x in (q, k, v))
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    scale = ftype(scale if scale else 1.0 / np.sqrt(d))
    o = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], -np.inf)
    for i in range(len(qo_indptr) - 1):
        q0, q1, k0, k1 = qo_indptr[i], qo_indptr[i + 1], kv_indptr[i], kv_indptr[i + 1]
        qo_len, kv_len = q1 - q0, k1 - k0
        if qo_len == 0:
            continue
        rows = np.arange(qo_len)[:, None] + kv_len - qo_len
        keys = np.arange(kv_len)[None, :]
        visible = np.ones((qo_len, kv_len), bool)
        if causal:
            visible &= keys <= rows
        if window_left >= 0:
            visible &= keys >= rows - window_left
        for h in range(hq):
            kh, vh = k[k0:k1, h // group], v[k0:k1, h // group]
            s = (q[q0:q1, h] @ kh.T) * scale
            if soft_cap > 0:
                s = ftype(soft_cap) * np.tanh(s / ftype(soft_cap))
            s = np.where(visible, s, -np.inf)
            m = s.max(axis=1, keepdims=True) if kv_len else np.full((qo_len, 1), -np.inf)
            any_key = np.isfinite(m[:, 0])
            m = np.where(np.isfinite(m), m, 0)
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True)
            if lowp:
                p = round_mantissa(p / total, MANTISSA_BITS[lowp])
                out = round_mantissa(p @ vh, MANTISSA_BITS[lowp])
            else:
                out = (p @ vh) / np.where(total > 0, total, 1)
            o[q0:q1, h] = np.where(any_key[:, None], out, 0)
            lse[q0:q1, h] = np.where(any_key, (m[:, 0] + np.log(np.where(total[:, 0] > 0, total[:, 0], 1))), -np.inf)
    return o, lse


def merge(o_a, s_a, o_b, s_b):
    """fp64 merge of two states (o [rows, heads, d], s [rows, heads])."""
    s = np.logaddexp(s_a, s_b)
    safe = np.where(np.isfinite(s), s, 0)
    w_a = np.where(np.isfinite(s_a), np.exp(s_a - safe), 0)[..., None]
    w_b = np.where(np.isfinite(s_b), np.exp(s_b - safe), 0)[..., None]
    return o_a * w_a + o_b * w_b, s


def check_rule(got, ref, naive_err, floor, what):
    """The tolerance rule: max |got - ref| <= 2 * naive_err + floor, NaN where ref is NaN only."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "%s: NaN positions differ" % what
    finite = np.isfinite(ref)
    assert np.array_equal(got[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)]), "%s: infinities differ" % what
    err = np.max(np.abs(got[finite] - ref[finite])) if finite.any() else 0.0
    tol = 2 * naive_err + floor
    assert err <= tol, "%s: max error %.3g exceeds 2 x %.3g + %.3g" % (what, err, naive_err, floor)
    return err


def max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    return float(np.max(np.abs(a[finite] - b[finite]))) if finite.any() else 0.0
