"""How every dataset draws: a training batch is a pure function of its coordinates (seed, step,
micro-batch; each rank takes its rows of the global batch), so a resumed run sees exactly the batches
an uninterrupted one would, with no loader state to save; validation draws the same items in every run.
"""

import torch

VAL_SEED = 2024  # the validation items and the sample prompts, identical across runs


def step_generator(seed: int, step: int, micro: int, *stream: int) -> torch.Generator:
    """The generator of one micro-batch's draws; `stream` tells independent draws of it apart."""
    return torch.Generator().manual_seed(hash((seed, step, micro, *stream)) & (2**62 - 1))
