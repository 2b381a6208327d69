"""Sample grids: every image gets its tile, the right way up."""

import numpy as np
import torch

from experiments.runtime.image_grid import grid


def where(sheet, colour):
    """(rows, columns) of the sheet's pixels of exactly this colour."""
    return (np.asarray(sheet) == np.asarray(colour, dtype=np.uint8)).all(-1).nonzero()


def test_a_partial_last_row_is_kept():
    colours = torch.eye(3).repeat(2, 1)[:5]  # red, green, blue, red, green: five tiles, four to a row
    colours[3:] *= 0.5
    images = colours[:, :, None, None].expand(5, 3, 2, 2)
    sheet = grid(images, [f"image {i}" for i in range(5)], columns=4, cell=8)
    for colour in colours:
        assert len(where(sheet, (colour * 255).round().tolist())[0]) == 8 * 8  # one whole tile each


def test_an_image_is_drawn_the_right_way_up():
    image = torch.zeros(1, 3, 4, 4)
    image[0, 0, :2] = 1  # red in its top half
    image[0, 2, 2:] = 1  # blue in its bottom half
    sheet = grid(image, ["red over blue"], cell=8)
    (red_y, red_x), (blue_y, blue_x) = where(sheet, (255, 0, 0)), where(sheet, (0, 0, 255))
    assert len(red_y) == len(blue_y) == 8 * 4
    assert red_y.max() < blue_y.min() and set(red_x) == set(blue_x)
