"""Caption tokenizers: padding, truncation and the round trip through tokenize and decode."""

import pytest

from experiments.data.tokenizer import ByteTokenizer, WordTokenizer, tokenize
from experiments.runtime.errors import UserError

WORDS = WordTokenizer(["a", "small", "red", "square", "at", "the", "top", "left"])


@pytest.mark.parametrize("tokenizer", [WORDS, ByteTokenizer()], ids=["words", "bytes"])
def test_a_padded_caption_decodes_back_to_itself(tokenizer):
    captions = ["a red square", "a small red square at the top left"]
    length = len(tokenizer.encode(captions[1])) + 3  # every row ends in padding
    ids = tokenize(tokenizer, captions, length, truncate=False)
    assert [tokenizer.decode(row) for row in ids] == captions


@pytest.mark.parametrize("tokenizer", [WORDS, ByteTokenizer()], ids=["words", "bytes"])
def test_truncation_keeps_the_start_of_a_caption(tokenizer):
    caption = "a small red square at the top left"
    ids = tokenize(tokenizer, [caption], 3, truncate=True)
    assert ids[0].tolist() == tokenizer.encode(caption)[:3]
    assert caption.startswith(tokenizer.decode(ids[0]))
    with pytest.raises(UserError, match="data.text_seq_len=3"):
        tokenize(tokenizer, [caption], 3, truncate=False)
