"""Speculative decoding (Leviathan et al. 2023): a draft model proposes `gamma` tokens, the target
scores them all in one forward pass, and the accept/reject rule keeps the output distributed
exactly as the target's own sampling.

Rule, with p the target's and q the draft's distribution (same temperature and top-k as plain
decoding): accept draft token x with probability min(1, p(x) / q(x)); at the first rejection
sample from normalise(max(0, p - q)) and stop; when all gamma are accepted, sample a bonus token
from p. At temperature 0 both distributions are one-hot, so the output is the target's greedy
decoding token for token.

Rows of a batch decode independently, each with its own caches, so rows that accept different
numbers of tokens need no padding; rejected tokens are rolled back per row with
`TransformerLM.truncate_cache`.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from models.sampling import decoding_linears, probabilities


@dataclass
class SpeculativeStats:
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verification step

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(1, len(self.accepted))


def _draw(probs: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """One token from probs [vocab] (a one-hot distribution gives its token)."""
    return torch.multinomial(probs, 1, generator=generator)[0]


def _uniform(device, generator: Optional[torch.Generator]) -> float:
    return float(torch.rand((), device=device, generator=generator))


def verify(p_probs: Tensor, q_probs: list[Tensor], drafted: list[int],
           generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """The accept/reject rule for one verification step.

    p_probs [len(drafted) + 1, vocab]: the target's distributions before each drafted token and
    after the last; q_probs: the draft's distributions the tokens were drawn from.
    Returns (number of drafted tokens accepted, the token that follows them)."""
    for i, token in enumerate(drafted):
        p, q = p_probs[i], q_probs[i]
        if _uniform(p.device, generator) < min(1.0, float(p[token] / q[token])):
            continue
        residual = (p - q).clamp(min=0)
        return i, int(_draw(residual / residual.sum() if residual.sum() > 0 else p, generator))
    return len(drafted), int(_draw(p_probs[len(drafted)], generator))  # all accepted: a bonus token


def verify_greedy(predicted: Tensor, drafted: Tensor) -> tuple[int, Tensor]:
    """`verify` at temperature 0, where p and q are one-hot: a drafted token is accepted exactly
    when it is the target's argmax, and the token after the accepted ones is the target's argmax
    there (the residual max(0, p - q) of a rejection is p itself). One row: predicted [..., g + 1],
    the target's argmax before each drafted token and after the last; drafted [..., g] -> (how many
    were accepted, the target's token after them [..., 1]). One host sync; no random numbers."""
    accepted = int((predicted[..., :-1] == drafted).cumprod(-1).sum())
    return accepted, predicted[..., accepted : accepted + 1]


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    prompt: Tensor,
    length: int,
    gamma: int = 5,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, SpeculativeStats]:
    """Decode `length` tokens after prompt [batch, prime] -> (tokens [batch, length], stats)."""
    if gamma < 1:
        raise ValueError(f"gamma={gamma} must be at least 1")
    stats = SpeculativeStats()
    with decoding_linears(target, draft):
        rows = [_generate_row(target, draft, row[None], length, gamma, temperature, top_k, generator, stats)
                for row in prompt]
    return torch.stack(rows), stats


def _generate_row(target, draft, prompt, length, gamma, temperature, top_k, generator, stats) -> Tensor:
    seq = prompt[0].tolist()
    start = len(seq)
    t_cache, d_cache = target.new_cache(), draft.new_cache()
    t_len = d_len = 0  # tokens of seq each cache holds
    device = prompt.device
    greedy = temperature == 0  # one-hot distributions: the rule reduces to comparing argmaxes
    while len(seq) - start < length:
        g = min(gamma, length - (len(seq) - start) - 1)  # the round always adds one more token
        # draft g tokens, feeding the draft whatever of seq it has not seen yet
        drafted, q_probs = [], []
        feed = torch.tensor([seq[d_len:]], device=device)
        for _ in range(g):
            logits = draft(feed, cache=d_cache)[0, -1]
            d_len += feed.shape[1]
            if greedy:  # the one-hot distribution's token, without building it
                token = logits.argmax()
            else:
                q_probs.append(probabilities(logits.float(), temperature, top_k))
                token = _draw(q_probs[-1], generator)
            drafted.append(int(token))
            feed = token.view(1, 1)
        # the target scores the unseen part of seq and every drafted token in one pass
        fresh = seq[t_len:]
        logits = target(torch.tensor([fresh + drafted], device=device), cache=t_cache)[0, len(fresh) - 1 :]
        t_len += len(fresh) + g
        if greedy:
            accepted, new_token = verify_greedy(logits.argmax(-1), torch.tensor(drafted, device=device))
            new_token = int(new_token)
        else:
            p_probs = probabilities(logits.float(), temperature, top_k)  # [g + 1, vocab]
            accepted, new_token = verify(p_probs, q_probs, drafted, generator)
        if g:
            stats.accepted.append(accepted)
        committed = len(seq) + accepted  # seq before this round, plus the accepted draft tokens
        seq += drafted[:accepted] + [new_token]
        t_len, d_len = min(t_len, committed), min(d_len, committed)
        target.truncate_cache(t_cache, t_len)
        draft.truncate_cache(d_cache, d_len)
    return torch.tensor(seq[start : start + length], device=device)
