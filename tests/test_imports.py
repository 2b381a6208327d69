"""The project imports and trains where Triton is not installed (macOS, Windows, a CPU-only box):
nothing imports Triton until a Triton kernel runs, and asking for one says in one line what is missing."""

import os
import subprocess
import sys

from tests.helpers.runs import ROOT

WITHOUT_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):  # as where Triton is not installed
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
"""

CHECKS = """
import torch
import kernels, models.lm
from kernels import dispatch
from models.lm import dsa_lm, moba_lm, nsa_lm

assert not dispatch.TRITON_INSTALLED and not dispatch.triton_runnable()
backbone = dict(num_tokens=256, dim=32, depth=1, heads=2, dim_head=16)
tokens = torch.randint(0, 256, (1, 64))
models = [nsa_lm(**backbone, kv_heads=1, sliding_window_size=16, compress_block_size=8, compress_stride=4,
                 fine_block_size=16, num_fine_selected=3, kernel=kernel) for kernel in ("auto", "torch")]
models += [moba_lm(**backbone, kv_heads=1, block_size=16, top_k=2), dsa_lm(**backbone, kv_heads=1, index_heads=2,
           index_dim_head=16, top_k=8, warmup_steps=0, kl_weight=1.0)]
for model in models:
    model(tokens).logsumexp(-1).mean().backward()  # the C kernels and torch train
try:
    nsa_lm(**backbone, kv_heads=1, sliding_window_size=16, compress_block_size=8, compress_stride=4,
           fine_block_size=16, num_fine_selected=3, kernel="triton")
except ValueError as e:
    print("refused:", e)
assert "triton" not in sys.modules, "something imported Triton"
"""


def test_the_project_imports_and_trains_without_triton():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON + CHECKS], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stderr[-3000:]
    refusal = result.stdout.strip().splitlines()[-1]
    assert refusal == "refused: kernel=triton needs Triton installed (pip install triton, on Linux): " \
                      "use model.kernel=auto or torch"
