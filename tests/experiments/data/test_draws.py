"""experiments/data/draws.py: every coordinate of a draw is its own: no two (seed, step, micro,
stream) of a grid seed their generators alike (an aliasing such as seed + step would give seed 1's
step 3 the batches of seed 0's step 4)."""

import itertools

from experiments.data.draws import step_generator


def test_no_two_coordinates_share_a_generator():
    grid = list(itertools.product(range(4), range(8), range(4), ((), (0,), (1,))))
    seeds = {step_generator(seed, step, micro, *stream).initial_seed() for seed, step, micro, stream in grid}
    assert len(seeds) == len(grid)

