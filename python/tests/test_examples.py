"""The examples/ scripts run as a user would run them (they need a GPU and PyTorch)."""
import os

import pytest

from conftest import HAVE_TORCH_GPU, NO_GPU_REASON, REPO, run_python

EXAMPLES = sorted(f for f in os.listdir(os.path.join(REPO, "examples")) if f.endswith(".py"))


def test_examples_exist():
    assert "prefill_vs_sdpa.py" in EXAMPLES and "decode_cuda_graph.py" in EXAMPLES


@pytest.mark.skipif(not HAVE_TORCH_GPU, reason=NO_GPU_REASON or "the examples need PyTorch with CUDA")
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    r = run_python([os.path.join(REPO, "examples", name)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout
