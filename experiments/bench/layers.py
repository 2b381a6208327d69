"""The settings a layer benchmark runs at, and the layers they build: a dense GQA layer (projections
and SDPA) and NSA (models/attention/nsa.py) on a chosen kernel path.

Settings: `paper` is the NSA paper's kernel setting (dim 1024; 64 query heads over 4 KV heads,
dim_head 128; compressed blocks of 32 every 16; 16 selected blocks of 64; window 512); `small` the
seed's shape (dim 512; 8 query heads over 4 KV heads, dim_head 64; the same NSA knobs); `tiny` a
shape for checking the scripts themselves on a CPU; `count` and `count16` the shapes counted at
COUNT_TOKENS (the seed's GQA group of 2 with dim_head 64, the paper's group of 16 with dim_head 128).

Why COUNT_KNOBS at COUNT_TOKENS measure what the paper's knobs do at its lengths: Triton's
interpreter takes minutes beyond a few hundred tokens, so the count runs short, with the masks
scaled so that the kernels meet the same edges. What a kernel wastes is the ragged edge of its
mask inside a fixed tile (kernels/nsa_attention/triton.py: 64 query rows a program, 32 compressed
keys, 64 window keys, one fine block a tile), so each knob keeps its size in the unit it is
measured in. Against the sequence: 256 tokens hold 127 compressed blocks of 4 every 2 (as 512 did
of 8 every 4, and 2,048 do of the paper's 32 every 16: four 32-key tiles), 8 fine blocks of 32 of
which 8 are selected (3 forced, 5 free, as 512 did with blocks of 64), and the selection pass's
tiles are the same (16 compressed blocks start in a fine block). Against the tiles: the window
stays 256 keys, four 64-key tiles (halved it would be two, and its ragged edge would cost 1.5x the
pairs it needs instead of 1.25x); at 256 tokens it holds every key, so the window kernel walks its
causal edge only, at the same 1.25x. What scales with the tokens (launches do not; glue, q and
the largest tensor do) leaves the budgets' ratios as they were, except the glue: the compressor's
127 blocks now stand against half the tokens (tests/kernels/test_nsa_budgets.py says by how much).
"""

import torch.nn.functional as F
from torch import Tensor, nn

NSA_KNOBS = dict(compress_block_size=32, compress_stride=16, fine_block_size=64, num_fine_selected=16,
                 sliding_window_size=512)
COUNT_KNOBS = dict(compress_block_size=4, compress_stride=2, fine_block_size=32, num_fine_selected=8,
                   sliding_window_size=256)
SETTINGS = {
    "paper": dict(dim=1024, heads=64, kv_heads=4, dim_head=128, **NSA_KNOBS),
    "small": dict(dim=512, heads=8, kv_heads=4, dim_head=64, **NSA_KNOBS),
    "tiny": dict(dim=64, heads=4, kv_heads=2, dim_head=16, compress_block_size=8, compress_stride=4,
                 fine_block_size=16, num_fine_selected=4, sliding_window_size=32),
    "count": dict(dim=128, heads=2, kv_heads=1, dim_head=64, **COUNT_KNOBS),
    "count16": dict(dim=256, heads=16, kv_heads=1, dim_head=128, **COUNT_KNOBS),
}
COUNT_TOKENS = 256
PAPER_TOKENS = [16384, 32768, 65536]  # the lengths the paper times its kernels at (its figure 6: 8k to 64k)


class DenseLayer(nn.Module):
    """Dense causal GQA attention with its projections: x [batch, seq, dim] -> [batch, seq, dim]."""

    def __init__(self, dim: int, heads: int, kv_heads: int, dim_head: int, **_):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q = self.to_q(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k, v = self.to_kv(x).unflatten(-1, (2, self.kv_heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.to_out(out.transpose(1, 2).flatten(2))


def nsa_layer(kernel: str, setting: dict) -> nn.Module:
    """NSA at the setting on `kernel` (auto, triton, cpu, torch: models/attention/nsa.py)."""
    from models.attention.nsa import NativeSparseAttention

    return NativeSparseAttention(**setting, kernel=kernel)


def describe(name: str, setting: dict) -> str:
    return (f"{name}: dim {setting['dim']}, {setting['heads']} query heads over {setting['kv_heads']} KV heads, "
            f"dim_head {setting['dim_head']}; compressed blocks of {setting['compress_block_size']} every "
            f"{setting['compress_stride']}, {setting['num_fine_selected']} selected blocks of "
            f"{setting['fine_block_size']}, window {setting['sliding_window_size']}")
