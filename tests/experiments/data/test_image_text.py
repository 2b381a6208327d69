"""data=image_folder: folders and tar shards of captioned images, and what goes wrong in them."""

import io
import logging
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from experiments.runtime.errors import UserError
from experiments.data.image_text import ImageTextFolder


def png(colour, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path):
    for i, colour in enumerate(["red", "green", "blue", "yellow"]):
        (tmp_path / f"img{i}.png").write_bytes(png(colour))
        (tmp_path / f"img{i}.txt").write_text(f"a {colour} picture\nanother {colour} caption\n")
    (tmp_path / "uncaptioned.png").write_bytes(png("white"))
    return tmp_path


def test_folder_pairs_images_with_captions_and_leaves_out_the_uncaptioned(folder, caplog):
    with caplog.at_level(logging.WARNING):
        data = ImageTextFolder(str(folder), image_size=16, text_seq_len=32, val_fraction=0.25)
    assert "1 of 5 images" in caplog.text
    assert len(data.train_items) == 3 and len(data.val_items) == 1
    text, images = data.train_batch(6, seed=0, step=0)
    assert text.shape == (6, 32) and images.shape == (6, 3, 16, 16)
    assert 0 <= images.min() and images.max() <= 1
    for row, image in zip(text, images):  # each caption names its image's colour
        words = data.tokenizer.decode(row)
        colour = words.split()[1]
        rgb = np.array(Image.new("RGB", (1, 1), colour).getpixel((0, 0))) / 255
        torch.testing.assert_close(image.mean((1, 2)), torch.tensor(rgb, dtype=torch.float32), atol=0.02, rtol=0)
    again = data.train_batch(6, seed=0, step=0)
    assert torch.equal(text, again[0]) and torch.equal(images, again[1])
    assert data.prompts(2) == ["a yellow picture", "a yellow picture"]


def test_unreadable_images_are_skipped_with_a_warning(folder, caplog):
    (folder / "img1.png").write_bytes(b"not an image")
    data = ImageTextFolder(str(folder), image_size=8, text_seq_len=32, val_fraction=0.25)
    with caplog.at_level(logging.WARNING):
        for step in range(6):
            _, images = data.train_batch(4, seed=0, step=step)
            assert images.shape == (4, 3, 8, 8)
    assert "img1" in caplog.text and "cannot be read" in caplog.text


def test_long_captions_are_an_error_before_training_or_truncated(folder):
    (folder / "img2.txt").write_text("a caption far longer than the text length allows\n")
    with pytest.raises(UserError, match="img2.*text_seq_len=24"):
        ImageTextFolder(str(folder), image_size=8, text_seq_len=24)
    data = ImageTextFolder(str(folder), image_size=8, text_seq_len=24, truncate_captions=True)
    assert data.train_batch(2, seed=0, step=0)[0].shape == (2, 24)


@pytest.mark.parametrize("folder", ["", "./", "v1.0/"], ids=["top", "dot", "folder-with-a-dot"])
def test_tar_shards_in_the_webdataset_layout(tmp_path, folder):
    """A member's key is its path up to the first dot of its file's name (`tar -C dir -cf x.tar .`
    writes ./0000.png)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(2):
        with tarfile.open(shards / f"shard{s}.tar", "w") as tar:
            for i in range(3):
                for name, payload in ((f"{folder}{s}{i:03d}.png", png("blue")),
                                      (f"{folder}{s}{i:03d}.txt", b"a blue square")):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    data = ImageTextFolder(str(shards), image_size=8, text_seq_len=16, val_fraction=0.2)
    assert len(data.train_items) + len(data.val_items) == 6
    text, images = next(data.val_batches(1, 2))
    assert data.tokenizer.decode(text[0]) == "a blue square" and images.shape == (2, 3, 8, 8)


def test_the_fingerprint_names_the_split_and_the_images(folder):
    data = ImageTextFolder(str(folder), image_size=8, text_seq_len=32, val_fraction=0.25)
    assert data.fingerprint.split(":")[1] == "3+1"
    assert ImageTextFolder(str(folder), image_size=8, text_seq_len=32, val_fraction=0.5).fingerprint != data.fingerprint
    (folder / "img0.png").write_bytes(png("red", size=(41, 30)))  # another image under the same name
    again = ImageTextFolder(str(folder), image_size=8, text_seq_len=32, val_fraction=0.25)
    assert again.fingerprint != data.fingerprint


def test_a_missing_or_empty_path_is_refused(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        ImageTextFolder(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="found 0 captioned images"):
        ImageTextFolder(str(tmp_path))


def test_a_trained_bpe_tokenizer_is_an_option_and_rebuilds_from_its_spec(folder, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from experiments.data.tokenizer import from_spec

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["a red picture", "a green picture", "another blue caption"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    path = tmp_path / "bpe.json"
    bpe.save(str(path))
    data = ImageTextFolder(str(folder), image_size=8, text_seq_len=8, tokenizer=str(path))
    assert data.tokenizer.decode(data.tokenizer.encode("a red picture")) == "a red picture"
    assert len(data.tokenizer.encode("a red picture")) == 3  # pieces, not bytes
    text, _ = next(data.val_batches(1, 1))  # "a yellow picture": unseen pieces, still within 8 ids
    assert text.shape == (1, 8) and (text[0] > 0).any()
    rebuilt = from_spec(data.tokenizer.spec())
    assert rebuilt.encode("a red picture") == data.tokenizer.encode("a red picture")
    with pytest.raises(UserError, match="no such tokenizer file"):
        ImageTextFolder(str(folder), tokenizer=str(tmp_path / "missing.json"))
