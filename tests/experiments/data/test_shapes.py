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
