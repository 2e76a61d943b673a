"""The CPU runtime's process-wide tuning: oneDNN's per-shape caches stay bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend_engine.worker import cpu_runtime

ROOT = Path(__file__).resolve().parents[3]
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

# In a fresh process (oneDNN reads its cache sizes once): tune, then run packed linears of
# three weight shapes at 120 row counts, each a batch size the engine could step with, and
# report how much more memory malloc hands out afterwards.
_SCRIPT = """
import ctypes, json, sys
import torch
from torch import nn
from backend_engine.worker.cpu_runtime import tune_cpu_runtime
from backend_engine.models.packed_linear import PackedLinear

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

def in_use_mib():
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20

if sys.argv[1] == "tuned":
    tune_cpu_runtime()
torch.set_num_threads(1)
shapes = [(256, 768), (768, 256), (256, 4096)]
layers = [PackedLinear(nn.Linear(i, o)) for i, o in shapes]
inputs = [torch.randn(512, i) for i, _ in shapes]
with torch.inference_mode():
    for layer, x in zip(layers, inputs):
        layer(x[:17])
    start = in_use_mib()
    for rows in range(17, 137):
        for layer, x in zip(layers, inputs):
            layer(x[:rows])
print(json.dumps({"growth_mib": in_use_mib() - start}))
"""


def _growth_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return float(json.loads(done.stdout.splitlines()[-1])["growth_mib"])


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"),
    reason="oneDNN is not built into this PyTorch",
)
def test_new_batch_sizes_do_not_grow_memory_past_the_onednn_cache_bound() -> None:
    """Each new row count used to add oneDNN cache entries until 1024 of them were held
    (hundreds of MB for the demo models): the engine's RSS grew under load."""
    try:
        growth = _growth_mib("tuned")
    except subprocess.CalledProcessError as exc:
        if "mallinfo2" in exc.stderr:
            pytest.skip("the C library has no mallinfo2 (not glibc)")
        raise
    # 360 (shape, rows) combinations; the bound keeps 64 per cache (~20 MB here; unbounded,
    # the same run takes well over 100 MB).
    assert growth < 50, f"malloc grew {growth:.1f} MiB over 120 batch sizes"


def test_the_environment_overrides_the_onednn_cache_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    cpu_runtime.bound_onednn_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(cpu_runtime.ONEDNN_CACHE_CAPACITY)
