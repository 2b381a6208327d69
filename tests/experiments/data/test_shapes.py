"""data=shapes: reproducible captioned batches, and a detector that reads drawn images back."""

import torch

from experiments.data.shapes import COLOURS, SHAPES, Shapes, caption, detect, draw, parse, score


def test_detector_reads_every_drawn_colour_and_shape():
    images, captions = [], []
    for colour in COLOURS:
        for shape in SHAPES:
            for size, row, column in (("small", "top", "left"), ("large", "bottom", "right"), ("small", "middle", "center")):
                images.append(torch.from_numpy(draw(32, size, colour, shape, row, column)))
                captions.append(caption(size, colour, shape, row, column))
    found = detect(torch.stack(images))
    assert [f["colour"] for f in found] == [parse(c)["colour"] for c in captions]
    assert [f["shape"] for f in found] == [parse(c)["shape"] for c in captions]
    assert score(torch.stack(images), captions) == {"colour_agreement": 1.0, "shape_agreement": 1.0}


def test_score_is_near_chance_for_mismatched_captions_and_skips_captions_without_attributes():
    data = Shapes(image_size=32)
    text, images = next(data.val_batches(1, 300))
    captions = [data.tokenizer.decode(t) for t in text]
    shuffled = captions[1:] + captions[:1]
    scores = score(images, shuffled)
    assert abs(scores["colour_agreement"] - 1 / 6) < 0.1 and abs(scores["shape_agreement"] - 1 / 3) < 0.12
    assert score(images[:2], ["an image", "another"]) == {}
    assert detect(torch.zeros(1, 3, 32, 32)) == [{"colour": None, "shape": None}]


def test_batches_are_reproducible_and_ranks_take_rows_of_the_global_batch():
    data = Shapes(image_size=16, text_seq_len=12)
    text, images = data.train_batch(4, seed=1, step=5)
    assert text.shape == (4, 12) and images.shape == (4, 3, 16, 16)
    again = data.train_batch(4, seed=1, step=5)
    assert torch.equal(text, again[0]) and torch.equal(images, again[1])
    assert not torch.equal(images, data.train_batch(4, seed=1, step=6)[1])
    whole = data.train_batch(4, seed=1, step=5)  # one process, the global batch
    second = data.train_batch(2, seed=1, step=5, rank=1, world_size=2)
    assert torch.equal(second[1], whole[1][2:]) and torch.equal(second[0], whole[0][2:])


def test_captions_round_trip_through_the_tokenizer_and_prompts_are_fixed():
    data = Shapes()
    text, _ = data.train_batch(8, seed=0, step=0)
    for row in text:
        words = data.tokenizer.decode(row)
        assert words.startswith("a ") and parse(words)["colour"] in COLOURS
    assert data.prompts(5) == Shapes().prompts(5)


def test_a_shape_lies_where_its_caption_puts_it():
    """Its foreground's centroid is in the half the caption names (top, left...) or the middle third."""
    data = Shapes(image_size=16)
    text, images = data.train_batch(64, seed=0, step=0)
    for row, image in zip(text, images):
        *_, vertical, horizontal = data.tokenizer.decode(row).split()
        y, x = (image.amax(0) > 0).nonzero().float().add(0.5).mean(0) / data.image_size
        for place, at in ((vertical, y), (horizontal, x)):
            if place in ("top", "left"):
                assert at < 0.5
            elif place in ("bottom", "right"):
                assert at > 0.5
            else:
                assert abs(at - 0.5) < 1 / 6


def test_validation_batches_differ_from_each_other_and_repeat_on_every_call():
    data = Shapes(image_size=16)
    first, second = data.val_batches(2, 4)
    assert not torch.equal(first[1], second[1])
    again = list(data.val_batches(2, 4))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip((first, second), again))


def test_a_large_shape_covers_more_pixels_than_a_small_one():
    for shape in SHAPES:
        large, small = (int((draw(32, size, "red", shape, "middle", "center").max(0) > 0).sum())
                        for size in ("large", "small"))
        assert large > small > 0
