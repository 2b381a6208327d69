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


def test_what_a_folder_cannot_say_plainly_is_refused_in_one_line(tmp_path, folder):
    """Loose images beside tar shards (only the shards would be read), two images of one caption, a
    caption that is not UTF-8, a single image file as the path."""
    with tarfile.open(folder / "backup.tar", "w") as tar:
        info = tarfile.TarInfo("z.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"z"))
    with pytest.raises(UserError, match="holds tar shards and loose images .*point data.path at a folder of one kind"):
        ImageTextFolder(str(folder))
    (folder / "backup.tar").unlink()
    (folder / "img0.jpg").write_bytes(png("red"))
    with pytest.raises(UserError, match=r"img0.jpg and img0.png share one caption \(img0.txt\): rename one"):
        ImageTextFolder(str(folder))
    (folder / "img0.jpg").unlink()
    (folder / "img1.txt").write_bytes("café crème".encode("latin-1"))
    with pytest.raises(UserError, match=r"the caption .*img1.txt is not UTF-8 \(byte 3\): save it as UTF-8"):
        ImageTextFolder(str(folder))
    with pytest.raises(UserError, match="is a file but not a tar shard: give the folder"):
        ImageTextFolder(str(folder / "img0.png"))


def test_a_byte_order_mark_tiff_images_and_sixteen_bit_grey_read_as_they_look(tmp_path):
    ramp = np.tile(np.linspace(0, 65535, 32).astype(np.uint16), (32, 1))
    Image.fromarray(ramp).save(tmp_path / "grey16.png")  # PIL reads it as mode I;16 or I
    (tmp_path / "grey16.txt").write_bytes("\ufeffa grey ramp".encode("utf-8"))
    Image.new("RGB", (32, 32), "red").save(tmp_path / "red.tif")
    (tmp_path / "red.txt").write_text("a red tiff")
    data = ImageTextFolder(str(tmp_path), image_size=32, text_seq_len=16, val_fraction=0.5, channels=1)
    assert sorted(item.key for item in data.train_items + data.val_items) == ["grey16", "red"]
    grey = next(i for i in data.train_items + data.val_items if i.key == "grey16")
    assert grey.captions == ["a grey ramp"]
    _, image = data._image([grey], 0, None)
    torch.testing.assert_close(image[0, 0], torch.linspace(0, 1, 32), atol=0.02, rtol=0)  # not clipped to white


def test_each_split_needs_a_readable_image_before_any_training(folder):
    (folder / "img3.png").write_bytes(b"not an image")  # the one validation item
    with pytest.raises(UserError, match="none of its validation split's 1 images can be read"):
        ImageTextFolder(str(folder), image_size=8, text_seq_len=32, val_fraction=0.25)


def quadrants(path, size=(60, 40)):
    """A landscape image: left third red, middle third green, right third blue; top rows brighter."""
    array = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    third = size[0] // 3
    for c in range(3):
        array[:, c * third:(c + 1) * third, c] = 255
    array[: size[1] // 2] //= 2  # the top half darker
    Image.fromarray(array).save(path)


def test_validation_takes_the_centre_square_the_right_way_up(tmp_path):
    for name in ("a", "b"):
        quadrants(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text("thirds")
    data = ImageTextFolder(str(tmp_path), image_size=40, text_seq_len=8, val_fraction=0.5)
    _, images = next(data.val_batches(1, 1))
    image = images[0]  # the centre 40x40 of 60x40: 10 columns of red, 20 green, 10 blue
    assert image.shape == (3, 40, 40)
    channel_of_column = image.mean(1).argmax(0)  # [40]: which colour each column is
    assert channel_of_column[:8].eq(0).all() and channel_of_column[12:28].eq(1).all()
    assert channel_of_column[32:].eq(2).all()
    assert image.amax(0)[:15].mean() < image.amax(0)[25:].mean()  # darker on top: not transposed or flipped


def test_training_crops_cover_between_resize_ratio_and_all_of_the_image(tmp_path):
    """Each crop's side is read back from an image whose columns count up: the span of values it holds."""
    ramp = np.tile(np.arange(200, dtype=np.uint8), (200, 1))  # column x holds the value x
    for name in ("a", "b"):
        Image.fromarray(np.stack([ramp] * 3, -1)).save(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text("a ramp")
    data = ImageTextFolder(str(tmp_path), image_size=64, text_seq_len=8, val_fraction=0.5, resize_ratio=0.5)
    sides = []
    for step in range(40):
        _, images = data.train_batch(1, seed=0, step=step)
        row = images[0, 0, 32] * 255
        sides.append(float(row[-2] - row[1]) * 64 / 61)  # ~ the crop's side in pixels
    areas = [side * side / (200 * 200) for side in sides]
    assert min(areas) > 0.5 * 0.9 and max(areas) <= 1.02
    assert max(areas) - min(areas) > 0.2  # drawn across the range, not one size


def test_training_draws_every_caption_line_and_validation_every_item(folder):
    data = ImageTextFolder(str(folder), image_size=8, text_seq_len=32, val_fraction=0.5)
    lines = {data.tokenizer.decode(row) for step in range(10) for row in data.train_batch(4, seed=0, step=step)[0]}
    assert {"a red picture", "another red caption"} <= lines
    seen = {data.tokenizer.decode(row) for text, _ in data.val_batches(2, 1) for row in text}
    assert seen == {f"a {item.captions[0].split()[1]} picture" for item in data.val_items} and len(seen) == 2


def test_an_image_whose_header_claims_a_huge_size_is_skipped_as_unreadable(folder, caplog):
    """PIL refuses it (a decompression bomb) with an error that is not an OSError: it ended a run."""
    import struct
    import zlib

    raw = bytearray(png("red"))
    raw[16:24] = struct.pack(">II", 20000, 20000)  # IHDR's width and height, 400M pixels
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))
    (folder / "img0.png").write_bytes(bytes(raw))
    data = ImageTextFolder(str(folder), image_size=8, text_seq_len=32, val_fraction=0.25)
    with caplog.at_level(logging.WARNING):
        for step in range(4):
            assert data.train_batch(3, seed=0, step=step)[1].shape == (3, 3, 8, 8)
    assert "img0" in caplog.text and "cannot be read" in caplog.text


@pytest.mark.parametrize("top", [255, 65535, 200_000])
def test_a_32_bit_grey_image_is_scaled_by_the_range_its_values_use(top):
    from experiments.data.image_text import _eight_bit

    image = Image.fromarray(np.array([[0, top // 2, top]], dtype=np.int32), "I")
    black, grey, white = np.asarray(_eight_bit(image))[0].tolist()
    assert black == 0 and abs(grey - 127.5) < 1 and white == 255
