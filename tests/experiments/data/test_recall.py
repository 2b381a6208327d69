"""MQAR and passkey data: every answer can be found in its own sequence, batches are reproducible
and shared out by rank, and impossible knobs are refused before anything trains."""

import pytest
import torch

from experiments.data.recall import MQAR, Passkey
from experiments.runtime.errors import UserError
from models.transformer import IGNORE


def mqar(**kw):
    return MQAR(**{"vocab_size": 64, "seq_len": 64, "num_kv_pairs": 8, "power_a": 0.01, "random_non_queries": True, **kw})


@pytest.mark.parametrize("knobs", [{}, {"seq_len": 32, "num_kv_pairs": 8}, {"vocab_size": 8192, "num_kv_pairs": 4}])
def test_every_mqar_answer_is_the_value_its_key_was_given(knobs):
    data = mqar(**knobs)
    inputs, targets, _ = data.train_batch(16, seed=3, step=5)
    n, half = data.num_kv_pairs, data.vocab_size // 2
    for x, y in zip(inputs, targets):
        pairs = dict(zip(x[0 : 2 * n : 2].tolist(), x[1 : 2 * n : 2].tolist()))
        assert len(pairs) == n and all(0 < k < half <= v < data.vocab_size for k, v in pairs.items())
        asked = (y != IGNORE).nonzero()[:, 0]
        assert len(asked) == n and (asked >= 2 * n - 1).all()  # one query per pair, after the pairs
        for p in asked.tolist():
            assert pairs[int(x[p])] == int(y[p])  # the input at an answer is the key, its target the value
        assert sorted(int(x[p]) for p in asked) == sorted(pairs)  # every key asked once


def test_mqar_pairs_start_anywhere_up_to_the_offset_and_needles_find_them():
    """max_pairs_offset: each item's pairs start at a drawn token in [0, offset], every query comes
    after them, and `needles` points each answer at its pair's value wherever the pairs lie."""
    data = mqar(vocab_size=8192, seq_len=64, num_kv_pairs=4, max_pairs_offset=24)  # no chance repeats of a pair
    inputs, targets, _ = data.train_batch(64, seed=0, step=0)
    needles = data.needles(inputs, targets)
    starts = []
    for x, y, found in zip(inputs, targets, needles):
        asked = (y != IGNORE).nonzero()[:, 0]
        assert len(asked) == 4
        values = found[asked]
        keys_at = values - 1
        assert (x[keys_at] == x[asked]).all() and (x[values] == y[asked]).all()  # key, then the value asked for
        start = int(keys_at.min())
        assert start <= 24 and (asked > start + 7).all()  # the pairs, then their queries
        assert sorted(keys_at.tolist()) == list(range(start, start + 8, 2))  # the four pairs lie together
        starts.append(start)
    assert len(set(starts)) > 10  # the pairs move from item to item
    assert (needles[targets == IGNORE] == -1).all()


@pytest.mark.parametrize("random_non_queries", [True, False])
def test_what_pairs_and_queries_leave_is_random_tokens_or_zeros(random_non_queries):
    data = mqar(num_kv_pairs=4, random_non_queries=random_non_queries)
    inputs, targets, _ = data.train_batch(8, seed=0, step=0)
    asked = (targets != IGNORE).nonzero()
    used = torch.zeros_like(inputs, dtype=torch.bool)
    used[:, : 2 * data.num_kv_pairs] = True  # the pairs
    used[asked[:, 0], asked[:, 1]] = True  # each query's key; its value follows
    used[asked[:, 0], (asked[:, 1] + 1).clamp(max=inputs.shape[1] - 1)] = True
    rest = inputs[~used]
    if random_non_queries:
        assert len(rest.unique()) > data.vocab_size // 2
    else:
        assert (rest == 0).all()


def test_mqar_pairs_start_at_every_offset_up_to_the_largest():
    data = mqar(vocab_size=8192, num_kv_pairs=4, max_pairs_offset=3)
    inputs, targets, _ = data.train_batch(64, seed=0, step=0)
    needles = data.needles(inputs, targets)
    starts = {int(found[y != IGNORE].min()) - 1 for y, found in zip(targets, needles)}
    assert starts == {0, 1, 2, 3}


def test_queries_reach_every_slot_that_fits_up_to_the_last_token():
    """An odd seq_len leaves the last input and target a whole query: the farthest slot is drawn too."""
    data = mqar(seq_len=15, num_kv_pairs=2, power_a=1.0)  # slots drawn uniformly
    _, targets, _ = data.train_batch(64, seed=0, step=0)
    positions = set((targets != IGNORE).nonzero()[:, 1].tolist())
    assert positions == set(range(2 * data.num_kv_pairs, data.seq_len, 2))


def test_mqar_query_gaps_follow_a_power_law():
    data = mqar(vocab_size=512, seq_len=256, num_kv_pairs=4)
    _, targets, _ = data.train_batch(256, seed=0, step=0)
    positions = (targets != IGNORE).nonzero()[:, 1]
    slots = (positions - 2 * data.num_kv_pairs) // 2
    near, far = (slots < 8).float().mean(), (slots >= 64).float().mean()
    assert near > 0.3 and 0 < far < near  # most queries come soon after the pairs, some far


def test_batches_are_reproducible_and_split_by_rank():
    data = mqar()
    whole = data.train_batch(6, seed=1, step=7, micro=1)
    again = data.train_batch(6, seed=1, step=7, micro=1)
    halves = [data.train_batch(3, seed=1, step=7, micro=1, rank=r, world_size=2) for r in (0, 1)]
    for i in range(3):
        assert torch.equal(whole[i], again[i])
        assert torch.equal(torch.cat([h[i] for h in halves]), whole[i])
    assert not torch.equal(data.train_batch(6, seed=1, step=8, micro=1)[0], whole[0])
    first, second = next(data.val_batches(1, 4)), next(data.val_batches(1, 4))
    assert torch.equal(first[0], second[0])  # validation: the same items every time


@pytest.mark.parametrize("knobs,message", [
    ({"seq_len": 16, "num_kv_pairs": 8}, "take 32 tokens, more than data.seq_len=16"),
    ({"vocab_size": 16, "num_kv_pairs": 8}, "data.vocab_size=16 has 7 key ids"),
    ({"num_kv_pairs": 0}, "data.num_kv_pairs=0 must be at least 1"),
    ({"power_a": 0.0}, "data.power_a=0.0 must be positive"),
    ({"seq_len": 64, "max_pairs_offset": 40}, "after data.max_pairs_offset=40"),
    ({"max_pairs_offset": -1}, "data.max_pairs_offset=-1 must be 0"),
])
def test_impossible_mqar_knobs_are_refused(knobs, message):
    with pytest.raises(UserError, match=message):
        mqar(**knobs)


def passkey(**kw):
    return Passkey(**{"seq_len": 256, "digits": 5, "depth_bins": 4, **kw})


def test_every_passkey_answer_is_the_number_hidden_at_its_depth():
    data = passkey()
    for inputs, targets, depth in [data.train_batch(8, seed=0, step=2), next(data.val_batches(1, 8))]:
        for x, y in zip(inputs, targets):
            text = data.decode(x)
            answer = bytes(y[y != IGNORE].tolist()).decode()
            assert len(answer) == 5 and answer.isdigit()
            assert f"The pass key is {answer}. Remember it. {answer} is the pass key." in text
            assert text.endswith("What is the pass key? The pass key is " + answer[:-1])
    depths = torch.cat([b[2] for b in data.val_batches(2, 8)])
    assert torch.bincount(depths, minlength=4).tolist() == [4, 4, 4, 4]  # every bin equally often


def test_passkeys_are_random_digits_in_random_filler():
    data = passkey()
    inputs, targets, _ = data.train_batch(8, seed=0, step=0)
    keys = [bytes(y[y != IGNORE].tolist()).decode() for y in targets]
    assert len(set(keys)) == len(keys) and any(len(set(key)) > 1 for key in keys)  # not one digit repeated
    fillers = set()
    for x, y, key in zip(inputs, targets, keys):
        text = bytes(torch.cat((x, y[-1:])).tolist())  # the whole item, its last digit included
        needle, question = data._needle(key).encode(), (data._QUESTION + key).encode()
        assert text.count(needle) == 1 and text.endswith(question)
        fillers.add(text[: -len(question)].replace(needle, b""))
    assert len(fillers) == len(keys)  # every row its own stretch of filler


def test_passkey_depth_bins_place_the_needle():
    data = passkey(seq_len=1024, depth_bins=4)
    inputs, targets, depth = next(data.val_batches(1, 4))
    places = [data.decode(x).index("The pass key is") / len(x) for x in inputs]
    assert depth.tolist() == [0, 1, 2, 3] and places == sorted(places)
    assert places[0] < 0.25 < places[1] < 0.5 < places[2] < 0.75 < places[3]


def test_passkey_depth_bins_are_part_of_the_data_set():
    """They move the validation items' needles, so runs with other bins saw other data."""
    assert passkey(seq_len=1024, depth_bins=4).fingerprint != passkey(seq_len=1024, depth_bins=5).fingerprint


def test_a_passkey_sequence_too_short_is_refused():
    with pytest.raises(UserError, match="data.seq_len=64 leaves no room"):
        passkey(seq_len=64)


def test_the_length_curriculum_trains_on_short_items_then_at_full_length():
    data = passkey(seq_len=1024, curriculum_seq_len=256, curriculum_steps=3)
    short, full = data.train_batch(2, seed=0, step=2), data.train_batch(2, seed=0, step=3)
    assert short[0].shape == (8, 256) and full[0].shape == (2, 1024)  # as many tokens a step either way
    for x, y in zip(short[0], short[1]):  # short items are whole passkey items, answer included
        answer = bytes(y[y != IGNORE].tolist()).decode()
        assert f"The pass key is {answer}. Remember it." in data.decode(x) and len(answer) == 5
    halves = [data.train_batch(1, seed=0, step=2, rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(torch.cat([h[0] for h in halves]), data.train_batch(2, seed=0, step=2, world_size=1)[0])
    assert next(data.val_batches(1, 2))[0].shape == (2, 1024)  # validation is always at seq_len
    # the lengths it says it trains at (what the loop counts FLOPs at) are those it draws
    assert [data.train_seq_len(s) for s in range(5)] == [256, 256, 256, 1024, 1024]
    assert data.train_seq_lens == (256, 1024)
    plain = passkey(seq_len=1024)
    assert plain.train_batch(2, seed=0, step=0)[0].shape == (2, 1024) and plain.name != data.name
    assert plain.train_seq_lens == (1024,) and plain.train_seq_len(0) == 1024


@pytest.mark.parametrize("knobs,message", [
    ({"curriculum_seq_len": 300}, "data.curriculum_seq_len=300 must divide data.seq_len=1024"),
    ({"curriculum_seq_len": 64}, "data.curriculum_seq_len=64 leaves no room"),
    ({"curriculum_steps": -1}, "data.curriculum_steps=-1 must be 0"),
])
def test_impossible_curriculum_knobs_are_refused(knobs, message):
    with pytest.raises(UserError, match=message):
        passkey(**{"seq_len": 1024, "curriculum_steps": 5, **knobs})


def test_mqar_needles_point_at_the_value_each_answer_copies():
    data = mqar()
    inputs, targets, _ = data.train_batch(8, seed=0, step=1)
    needles = data.needles(inputs, targets)
    asked = targets != IGNORE
    assert ((needles >= 0) == asked).all()
    rows = asked.nonzero()[:, 0]
    assert torch.equal(inputs[rows, needles[asked]], targets[asked])  # the value given in the pair
    assert torch.equal(inputs[rows, needles[asked] - 1], inputs[asked])  # right after the queried key


def test_passkey_needles_point_at_the_hidden_digits():
    data = passkey()
    inputs, targets, _ = next(data.val_batches(1, 4))
    needles = data.needles(inputs, targets)
    asked = targets != IGNORE
    assert ((needles >= 0) == asked).all()
    rows = asked.nonzero()[:, 0]
    assert torch.equal(inputs[rows, needles[asked]], targets[asked])
    assert (needles[asked] < inputs.shape[1] - 30).all()  # in the needle, not in the question at the end
