"""Rotary position embeddings (Su et al. 2021), applied to queries and keys by each attention."""

import torch
from torch import Tensor, nn


class Rotary(nn.Module):
    """Rotates each pair of channels (x[2i], x[2i+1]) by the angle position * base^(-2i / dim_head).

    In fp32 and fp64 (eager), as one complex multiplication of each pair by e^(i angle): one pass
    over x (0.5 ms against 4.3 ms for x * cos + swap(x) * sin on [2, 2, 8192, 64], AMD EPYC). Other
    dtypes (bf16 has no complex type), and code torch.compile traces, use x * cos + swap(x) * sin,
    with swap exchanging the two channels of each pair and sin signed (-sin, +sin) per pair. One call may rotate queries and
    keys stacked together, which halves the kernel launches of a decoding step's rotation."""

    def __init__(self, dim_head: int, base: float = 10_000.0):
        super().__init__()
        if dim_head % 2:
            raise ValueError(f"rotary embeddings need an even dim_head, got {dim_head}")
        inv_freq = base ** (-torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table: tuple[Tensor, Tensor] | None = None  # cos, signed sin [positions, dim_head]
        self._phases: Tensor | None = None  # e^(i angle) [positions, dim_head / 2], complex
        self._phase_table: Tensor | None = None  # (cos, sin) [positions, dim_head / 2, 2], fp32

    def _cos_sin(self, end: int, device, dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin for positions [0, end), computed once and grown by doubling
        (decoding asks for one more position per token)."""
        table = self._table
        if table is None or table[0].shape[0] < end or table[0].device != device or table[0].dtype != dtype:
            size = max(end, 2 * table[0].shape[0] if table is not None else 0, 256)
            angles = torch.outer(torch.arange(size, device=device, dtype=torch.float32), self.inv_freq.to(device))
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            self._table = table = (cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2))
        return table

    def _complex(self, end: int, device, dtype) -> Tensor:
        """e^(i angle) for positions [0, end) in the complex dtype of `dtype`, grown by doubling."""
        phases = self._phases
        if phases is None or phases.shape[0] < end or phases.device != device or phases.real.dtype != dtype:
            size = max(end, 2 * phases.shape[0] if phases is not None else 0, 256)
            angles = torch.outer(torch.arange(size, device=device, dtype=torch.float64), self.inv_freq.to(device).double())
            self._phases = phases = torch.polar(torch.ones_like(angles), angles).to(torch.complex64 if dtype == torch.float32
                                                                                   else torch.complex128)
        return phases

    def phases(self, end: int, device) -> Tensor:
        """(cos, sin) of each channel pair's angle at positions [0, end): [end, dim_head / 2, 2] fp32,
        for kernels that rotate as they read (kernels/span_attention/, kernels/nsa_attention/); the
        complex form's numbers (fp64 angles rounded once), kept real so torch.compile traces them,
        computed once and grown by doubling (in code torch.compile traces, computed in the graph: a
        cached table would be a side effect of the graph and a guard on the next call)."""
        if torch.compiler.is_compiling():
            angles = torch.arange(end, device=device, dtype=torch.float64)[:, None] * self.inv_freq.to(device).double()
            return torch.stack((angles.cos(), angles.sin()), dim=-1).float()
        table = self._phase_table
        if table is None or table.shape[0] < end or table.device != torch.device(device):
            size = max(end, 2 * table.shape[0] if table is not None else 0, 256)
            angles = torch.outer(torch.arange(size, device=device, dtype=torch.float64), self.inv_freq.to(device).double())
            self._phase_table = table = torch.stack((angles.cos(), angles.sin()), dim=-1).float()
        return table[:end]

    def forward(self, x: Tensor, start: int = 0, inverse: bool = False) -> Tensor:
        """Rotate x [..., seq, dim_head] whose first position is `start` (inverse: rotate back,
        which is also how a gradient goes back through the rotation)."""
        seq = x.shape[-2]
        # torch.compile fuses the real form into one kernel; it mishandles outputs that are complex
        # views (view_as_real of a product read back garbage sizes, torch 2.13 on the CPU)
        if x.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
            if x.stride(-1) != 1 or x.storage_offset() % 2 or any(stride % 2 for stride in x.stride()[:-1]):
                x = x.contiguous()  # pairs of channels must lie where complex numbers can
            phases = self._complex(start + seq, x.device, x.dtype)[start : start + seq]
            pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
            phases = phases.conj() if inverse else phases
            if torch.is_grad_enabled() and x.requires_grad:
                return torch.view_as_real(pairs * phases).flatten(-2)
            # outside autograd (inside the kernels' own functions) the product is written contiguous
            # whatever x's layout: the kernels take it as it is, without a second copy
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            torch.mul(pairs, phases, out=torch.view_as_complex(out.unflatten(-1, (-1, 2))))
            return out
        if torch.compiler.is_compiling():  # computed in the graph: a cached table would change its guards
            angles = torch.arange(start, start + seq, device=x.device, dtype=torch.float32)[:, None] * self.inv_freq
            cos = angles.cos().repeat_interleave(2, dim=-1).to(x.dtype)
            sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2).to(x.dtype)
        else:
            cos, sin = (t[start : start + seq] for t in self._cos_sin(start + seq, x.device, x.dtype))
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return x * cos + swapped * (-sin if inverse else sin)

    def at(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x [..., t, dim_head] whose positions are the tensor positions [t] (a static cache's
        decoding step, where the position lives on the device): the real form, traceable and one
        graph for every position. The angles are computed as the eager path computes them (fp64 for
        fp32 and fp64 x, fp32 otherwise), so a step gives the logits the growing cache gives."""
        wide = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
        angles = positions.to(wide)[:, None] * self.inv_freq.to(wide)
        cos = angles.cos().repeat_interleave(2, dim=-1).to(x.dtype)
        sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2).to(x.dtype)
        return x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin
