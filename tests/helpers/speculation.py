"""Greedy speculative decoding's rounds from its definition, each proposal decoded afresh: what
each round must accept. Every output-only check passes for any draft (the target decides every
token), so a draft that reads a stale cache shows only in how many of its tokens are accepted."""

import torch

from models.sampling import generate


def greedy_acceptances(draft, prompt, expected, length: int, gamma: int, shorten_last: bool) -> list[int]:
    """How many drafted tokens each round accepts when the draft proposes its own greedy
    continuation of the committed tokens and the target keeps the longest prefix of it that equals
    the target's greedy tokens. prompt [1, prime]; expected [1, >= length + gamma], the target's
    greedy continuation (a round near the end may check drafts past `length`). shorten_last: the
    loop drafts at most the tokens still owed less one, and records no round that drafts none
    (models/speculative.py); otherwise gamma every round (models/decoding.py's engine)."""
    done, accepted = 0, []
    while done < length:
        drafts = min(gamma, length - done - 1) if shorten_last else gamma
        if drafts == 0:
            done += 1
            continue
        committed = torch.cat([prompt, expected[:, :done]], dim=1)
        proposal = generate(draft, committed, drafts, temperature=0)[0]
        agree = proposal == expected[0, done : done + drafts]
        accepted.append(int(agree.long().cumprod(0).sum()))
        done += accepted[-1] + 1
    return accepted
