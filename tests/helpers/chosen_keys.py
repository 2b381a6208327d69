"""Random choices of keys for testing the sparse attention kernels: gather attention's top-k
indices and selected attention's fine blocks, with each query's own position or block first."""

import torch
from torch import Tensor


def random_indices(bh: int, m: int, start: int, top_k: int, generator: torch.Generator | None = None) -> Tensor:
    """Each query's own position first, then distinct random earlier keys, -1 where a query has
    fewer earlier keys than slots, and some slots left unused. -> indices [bh, m, top_k]"""
    positions = start + torch.arange(m)
    draws = torch.rand(bh, m, start + m, generator=generator)
    draws = draws.masked_fill(torch.arange(start + m) >= positions[:, None], -1.0)  # earlier keys only
    earlier = draws.topk(min(top_k - 1, start + m), dim=-1)
    picks = torch.where(earlier.values >= 0, earlier.indices, -1)
    picks = torch.nn.functional.pad(picks, (0, top_k - 1 - picks.shape[-1]), value=-1)
    picks = picks.masked_fill(torch.rand(picks.shape, generator=generator) < 0.2, -1)  # unused slots
    return torch.cat((positions[None, :, None].expand(bh, m, 1), picks), dim=-1)


def random_selection(bh: int, m: int, start: int, block: int, selected: int,
                     generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Each query's own block first (always valid), then random earlier blocks, repeats marked
    invalid. -> indices, valid [bh, m, selected]"""
    current = (start + torch.arange(m)) // block
    picks = [current[None].expand(bh, m)]
    for _ in range(selected - 1):
        picks.append((torch.rand(bh, m, generator=generator) * (current + 1)).long())
    indices = torch.stack(picks, -1)
    valid = torch.ones_like(indices, dtype=torch.bool)
    for s in range(1, selected):
        valid[..., s] = (indices[..., s : s + 1] != indices[..., :s]).all(-1)
    return indices, valid


def repeat_some_slots(indices: Tensor, valid: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """A choice with repeats: about half of the slots after the first copy an earlier slot's index and
    validity. indices, valid [.., slots] -> indices, valid, and which slots count [.., slots]: the
    valid ones that no earlier valid slot of their row names the same index as (a plain loop, to
    check the kernels' own de-duplication against)."""
    indices, valid = indices.clone(), valid.clone()
    slots = indices.shape[-1]
    for s in range(1, slots):
        source = (torch.rand(indices.shape[:-1], generator=generator) * s).long()[..., None]
        copy = torch.rand(indices.shape[:-1], generator=generator) < 0.5
        indices[..., s] = torch.where(copy, indices.gather(-1, source)[..., 0], indices[..., s])
        valid[..., s] = torch.where(copy, valid.gather(-1, source)[..., 0], valid[..., s])
    counts = valid.clone()
    for s in range(slots):
        for earlier in range(s):
            counts[..., s] &= ~(valid[..., earlier] & (indices[..., earlier] == indices[..., s]))
    return indices, valid, counts
