"""Random and skewed serving steps for prefill_plan (the eager one-tile grid against the fixed grid):
prints one tessera_bench prefill_plan argument line per step. Deterministic (seeded).
    python3 bench/sweeps/serving_steps.py | while read -r c; do tessera_bench prefill_plan $c max_batch_size=0; done
"""
import random
rng = random.Random(20261202)
out = []
def case(name, qo, kv, heads=(32, 8), hd=128):
    out.append(f"name={name} batch={len(qo)} num_qo_heads={heads[0]} num_kv_heads={heads[1]} head_dim={hd} page_size=16 causal=true lengths=list qo_lens={','.join(map(str, qo))} kv_lens={','.join(map(str, kv))}")
for i in range(20):
    b = rng.choice([2, 4, 8, 16, 32, 64])
    qo, kv = [], []
    for _ in range(b):
        r = rng.random()
        q = 1 if r < 0.4 else rng.choice([16, 64, 128, 256, 512, 1024, 2048])
        hist = int(min(65536, max(16, rng.lognormvariate(7.0, 1.6))))
        qo.append(q); kv.append(hist + q)
    case(f"rand{i}_b{b}", qo, kv)
# one long request beside many short ones, several ratios
for long_kv, n in [(16384, 15), (32768, 31), (65536, 7), (131072, 15)]:
    case(f"onelong{long_kv // 1024}k_b{n + 1}", [256] + [256] * n, [long_kv] + [1024] * n)
case("gqa1_tp_b64", [1] * 56 + [512] * 8, [rng.randint(16, 2048) for _ in range(56)] + [32768] + [1024] * 7, heads=(8, 1))
case("hd64_skew_b16", [128] + [512] * 15, [65536] + [2048] * 15, hd=64)
case("hd256_skew_b16", [128] + [512] * 15, [65536] + [2048] * 15, heads=(16, 4), hd=256)
print("\n".join(out))
