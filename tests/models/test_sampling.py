"""Decoding's linears: every path gives nn.Linear's results for every input size, the plan picks
the path measured fastest, and nothing is left behind on the modules afterwards."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kernels import few_row_linear
from models.lm import transformer_lm
from models import sampling
from models.sampling import decoding_linears, decoding_plan, generate

PATHS = ("plain", "vector", "matrix", "kernel")


@pytest.fixture(autouse=True)
def two_threads():
    """Slicing needs more than one thread; the machine may have fewer cores than CI."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def every_bucket(path):
    return {rows: path for rows, _ in sampling._BUCKETS}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (3, 1), (2, 5), (1, 40)], ids=str)
def test_every_path_equals_the_plain_product(shape, bias, path):
    torch.manual_seed(0)
    linear = nn.Linear(48, 64, bias=bias)
    x = torch.randn(*shape, 48)
    with torch.no_grad():
        expected = linear(x)
        with decoding_linears(linear, plan=every_bucket(path)):
            # an all-plain plan patches nothing (nor one of a kernel that could not be built here)
            assert ("forward" in vars(linear)) == (path != "plain" and (path != "kernel" or few_row_linear.available()))
            out = linear(x)
    assert "forward" not in vars(linear)  # nn.Linear.forward again after it
    assert out.shape == expected.shape
    assert out.is_contiguous()  # row-major like nn.Linear's: the next products and sdpa keep their fast paths
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_the_plan_takes_the_path_measured_fastest_for_each_bucket(monkeypatch):
    # each path advances a clock of its own by what it "costs": the plan must not depend on how
    # busy the machine is (sleeps of 10 ms misled it while other work ran)
    clock = [0.0]
    monkeypatch.setattr(sampling, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def timed(seconds_by_rows):
        def product(x, w, b, threads):
            clock[0] += seconds_by_rows(x.shape[0])
            return torch.nn.functional.linear(x, w, b)
        return product

    # plain is fastest for one row, vector for a few, matrix for many
    monkeypatch.setattr(sampling, "_PATHS", {
        "plain": timed(lambda rows: 0.0 if rows == 1 else 0.02),
        "vector": timed(lambda rows: 0.01 if rows == 1 else 0.0 if rows <= 4 else 0.02),
        "matrix": timed(lambda rows: 0.01 if rows <= 4 else 0.0)})
    monkeypatch.setattr(sampling, "_PLANS", {})
    linears = [nn.Linear(16, 32)]
    plan = decoding_plan(linears, 2)
    assert plan == {1: "plain", 4: "vector", 16: "matrix"}
    assert decoding_plan(linears, 2) is plan  # measured once per process for these shapes
    assert decoding_plan(linears, 1) == every_bucket("plain")  # one thread: nothing to spread
    assert sampling.describe_plan(plan) == "1 row plain, 2-4 rows vector, 5-16 rows matrix"
    times = sampling.plan_times(linears, 2)  # what it was chosen from: ms of a pass over the one weight
    assert times[1] == pytest.approx({"plain": 0.0, "vector": 10.0, "matrix": 10.0})
    assert times[16] == pytest.approx({"plain": 20.0, "vector": 20.0, "matrix": 0.0})
    assert sampling.describe_plan(plan, times).startswith("1 row plain (plain 0.00, vector 10.00, matrix 10.00 ms), ")
    assert sampling.plan_times(linears, 1) == {}  # nothing measured where only the plain product serves


def test_a_measured_plan_names_a_path_for_every_bucket():
    plan = decoding_plan([nn.Linear(64, 256), nn.Linear(256, 64)], 2)
    assert set(plan) == {rows for rows, _ in sampling._BUCKETS} and set(plan.values()) <= set(PATHS)


def test_measuring_a_plan_leaves_the_global_random_state_alone():
    """A plan is measured once a process: a draw from the global generator would shift a resumed
    run's dropout, or a sweep's later job's, from its first sample on."""
    linears = [nn.Linear(48, 192), nn.Linear(192, 48)]  # shapes no other test measures: no plan kept
    state = torch.random.get_rng_state()
    sampling.plan_times(linears, 2)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_nested_contexts_leave_the_outer_one_in_place():
    linear = nn.Linear(16, 32)
    with decoding_linears(linear, plan=every_bucket("vector")):
        sliced = vars(linear)["forward"]
        with decoding_linears(linear):
            assert vars(linear)["forward"] is sliced
        assert vars(linear)["forward"] is sliced
    assert "forward" not in vars(linear)


def test_linears_that_cannot_be_sliced_are_left_alone():
    odd, half = nn.Linear(16, 30), nn.Linear(16, 64).half()
    with decoding_linears(odd, half, plan=every_bucket("vector")):
        assert "forward" not in vars(odd) and "forward" not in vars(half)
    with decoding_linears(odd, half, plan=every_bucket("kernel")):
        assert ("forward" in vars(odd)) == few_row_linear.available()  # the kernel takes any fp32 shape
        assert "forward" not in vars(half)


@pytest.mark.parametrize("path", PATHS[1:])
def test_under_autocast_the_planned_linears_compute_as_nn_linear(path):
    """trainer.precision=bf16 samples under autocast: the products then run in bf16, as nn.Linear's
    do (inputs arrive in bf16, which the fp32 paths must never read as fp32)."""
    torch.manual_seed(0)
    model = transformer_lm(num_tokens=64, dim=32, depth=2, heads=2, dim_head=16).eval()
    tokens = torch.randint(0, 64, (1, 12))

    def last_logits():
        cache = model.new_cache()
        model(tokens[:, :-1], cache=cache)
        return model(tokens[:, -1:], cache=cache)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = last_logits()
        with decoding_linears(model, plan=every_bucket(path)):
            out = last_logits()
    assert out.dtype == expected.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_sliced_linears_keep_autograd_and_the_weights():
    torch.manual_seed(0)
    linear = nn.Linear(16, 32)
    x = torch.randn(1, 16, requires_grad=True)
    weight = linear.weight.detach().clone()
    with decoding_linears(linear, plan=every_bucket("matrix")):
        linear(x).sum().backward()  # with gradients on, the plain product runs
    assert x.grad is not None and torch.equal(linear.weight, weight)


@pytest.mark.parametrize("path", PATHS[1:])
def test_with_gradients_on_every_path_gives_nn_linears_gradients(path):
    if path == "kernel" and not few_row_linear.available():
        pytest.skip("no C compiler: the kernel path is the plain product here")
    torch.manual_seed(0)
    linear = nn.Linear(16, 32)
    x = torch.randn(2, 16, requires_grad=True)
    nn.functional.linear(x, linear.weight, linear.bias).square().sum().backward()
    expected = [t.grad.clone() for t in (x, linear.weight, linear.bias)]
    for t in (x, linear.weight, linear.bias):
        t.grad = None
    with decoding_linears(linear, plan=every_bucket(path)):
        linear(x).square().sum().backward()
    for got, want in zip((x.grad, linear.weight.grad, linear.bias.grad), expected):
        torch.testing.assert_close(got, want)


def test_each_bucket_takes_the_path_its_plan_names(monkeypatch):
    """One row (a decoding step), 2-4 rows, 5-16 rows: each through its own bucket's path."""
    calls = []

    def spy(name, product):
        def path(x, w, b, threads):
            calls.append((name, x.shape[0]))
            return product(x, w, b, threads)
        return path

    for name, product in list(sampling._PATHS.items()):
        monkeypatch.setitem(sampling._PATHS, name, spy(name, product))
    linear = nn.Linear(16, 32)
    with torch.no_grad(), decoding_linears(linear, plan={1: "vector", 4: "matrix", 16: "plain"}):
        for rows in (1, 2, 4, 5, 16, 17):
            linear(torch.randn(rows, 16))
    assert calls == [("vector", 1), ("matrix", 2), ("matrix", 4), ("plain", 5), ("plain", 16)]  # 17: nn.Linear's


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_leaves_exactly_k_tokens_a_chance_at_any_temperature(temperature):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    probs = sampling.probabilities(logits, temperature, top_k=5)
    assert torch.equal(probs > 0, sampling.filter_top_k(logits, 5) > float("-inf"))
    assert ((probs > 0).sum(-1) == 5).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("path", ["vector", "matrix", "kernel", None])  # None: the plan measured here
def test_generate_with_planned_linears_equals_module_by_module_decoding(path):
    torch.manual_seed(0)
    model = transformer_lm(num_tokens=64, dim=32, depth=2, heads=2, dim_head=16).eval()
    prompt = torch.randint(0, 64, (1, 12))
    with decoding_linears(model, plan=path and every_bucket(path)):  # generate's own context keeps this plan
        greedy = generate(model, prompt, 8, temperature=0.0)
    cache, out = model.new_cache(), []
    with torch.no_grad():
        logits = model(prompt, cache=cache)[:, -1]
        for _ in range(8):  # the same decoding through nn.Linear.forward
            out.append(logits.argmax(-1))
            logits = model(out[-1][:, None], cache=cache)[:, -1]
    assert torch.equal(greedy, torch.stack(out, 1))
