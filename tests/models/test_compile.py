"""torch.compile of every model the trainer compiles, whole (fullgraph=True: no graph break, so no
graph hands out tensors that alias its intermediates, which AOTAutograd's cache replayed with
garbage sizes in torch 2.13), against eager: outputs, the gradients of the input and of every
parameter, and the buffers a forward updates, over several calls of one compiled graph with new
inputs. NSA and MoBA run on their CPU kernels (custom operators: a disabled kernel would break the
graph); DSA in both stages, its indexer's KL compared with the output, and on its CPU kernels
(custom operators too) through AOTAutograd.
Random draws (dropout, Gumbel noise) are the eager ones (Inductor's fallback_random).

NSA and MoBA compile through Inductor, which decides the layouts its custom operators receive; the models
made of PyTorch operators alone through AOTAutograd without Inductor's code generation (the C++
compiler would take minutes of the suite): what can break there, graph breaks, aliasing and mutated
buffers, is decided before code generation. The training runs compiled through Inductor are
tests/experiments/runtime/test_backends.py's."""

import copy

import pytest
import torch

from kernels import span_attention
from kernels.nsa_attention.compressed import cpu_selection_available
from models.attention.dense import DenseAttention
from models.attention.dsa import DeepSeekSparseAttention
from models.attention.moba import MixtureOfBlockAttention
from models.attention.nsa import NativeSparseAttention
from models.attention.routing import RoutingAttention
from models.attention.sinkhorn import SinkhornAttention
from models.dalle import DALLE
from models.dvae import DiscreteVAE
from models.lm import transformer_lm

CALLS = 3  # of one compiled graph, each with new inputs


# each case: (model, inputs(generator) -> tuple, call(forward, inputs) -> the tensor compared)
def attention_case(layer):
    return layer, lambda gen: (torch.randn(2, 24, 32, generator=gen),), lambda forward, x: forward(*x)


def lm_case():
    model = transformer_lm(num_tokens=32, dim=32, depth=2, heads=2, dim_head=16, attn_dropout=0.1)
    return model, lambda gen: (torch.randint(0, 32, (2, 24), generator=gen),), lambda forward, x: forward(*x)


def dalle_case():
    model = DALLE(num_text_tokens=20, text_seq_len=6, num_image_tokens=12, image_fmap_size=4, dim=32, depth=2,
                  heads=2, dim_head=16, attn_types=["full", "axial_row"], shift_tokens=True)

    def inputs(gen):
        text, codes = torch.randint(1, 20, (2, 6), generator=gen), torch.randint(0, 12, (2, 16), generator=gen)
        return model.sequence(text, codes)

    return model, inputs, lambda forward, x: forward(x[0], targets=x[1])[0]  # the training loss


def dvae_case():
    model = DiscreteVAE(image_size=16, num_tokens=32, codebook_dim=16, num_layers=2, hidden_dim=16,
                        num_resnet_blocks=1, temperature=0.9, anneal_rate=0.0)
    return model, lambda gen: (torch.rand(2, 3, 16, 16, generator=gen),), lambda forward, x: forward(*x)[0]


def dsa_case(warmup_steps: int, kernel: str = "torch"):
    """DSA's output and its indexer's KL (the layer's aux_loss, which trains the indexer alone)."""
    layer = DeepSeekSparseAttention(dim=32, heads=4, dim_head=16, kv_heads=2, index_heads=2, index_dim_head=8,
                                    top_k=5, warmup_steps=warmup_steps, kl_weight=1.0, kernel=kernel)

    def call(forward, x):
        out = forward(*x)
        return out + getattr(forward, "_orig_mod", forward).aux_loss

    return layer, lambda gen: (torch.randn(2, 24, 32, generator=gen),), call


needs_c = pytest.mark.skipif(not (span_attention.available() and cpu_selection_available()),
                             reason="no C compiler for NSA's CPU kernels")
CASES = {
    "dense": lambda: attention_case(DenseAttention(dim=32, heads=2, dim_head=16, dropout=0.1)),
    "sinkhorn": lambda: attention_case(SinkhornAttention(dim=32, heads=2, dim_head=16, bucket_size=4,
                                                         n_local_attn_heads=1)),
    "routing": lambda: attention_case(RoutingAttention(dim=32, heads=2, dim_head=16, window_size=4, num_clusters=3,
                                                       n_local_attn_heads=1)),
    "nsa": lambda: attention_case(NativeSparseAttention(dim=32, heads=4, dim_head=16, kv_heads=2,
                                                        sliding_window_size=8, compress_block_size=4,
                                                        compress_stride=2, fine_block_size=4, num_fine_selected=3,
                                                        kernel="cpu")),
    "moba": lambda: attention_case(MixtureOfBlockAttention(dim=32, heads=4, dim_head=16, kv_heads=2, block_size=4,
                                                           top_k=3, kernel="cpu")),
    "dsa-warm-up": lambda: dsa_case(warmup_steps=10),
    "dsa": lambda: dsa_case(warmup_steps=0),
    "dsa-c": lambda: dsa_case(warmup_steps=0, kernel="auto"),  # on the CPU: its C kernels, custom operators
    "lm": lm_case,  # the speculative pair's members (and the LM task's model)
    "dalle": dalle_case,
    "dvae": dvae_case,
}


INDUCTOR = {"nsa", "moba"}  # on their C kernels (custom operators), through Inductor


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    torch._dynamo.reset()  # compiled graphs hold guards on these modules: none outlive the test


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_c) if n in INDUCTOR | {"dsa-c"} else n for n in CASES])
def test_compiled_whole_equals_eager(name):
    torch.manual_seed(0)
    model, make_inputs, call_with = CASES[name]()
    model.train()
    eager = copy.deepcopy(model)  # its own buffers: a forward may update them (routing's k-means statistics)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if name in INDUCTOR else "aot_eager")
    gen = torch.Generator().manual_seed(1)
    for call in range(CALLS):
        inputs = make_inputs(gen)
        leaves = [x.requires_grad_() if x.is_floating_point() else x for x in inputs]
        results = []
        for module, forward in ((model, compiled), (eager, eager)):
            torch.manual_seed(call)
            with torch._inductor.config.patch(fallback_random=True):
                out = call_with(forward, leaves)
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(call))
            wrt = [x for x in leaves if x.requires_grad] + list(module.parameters())
            grads = torch.autograd.grad((out * weights).sum(), wrt, allow_unused=True)
            results.append((out, grads, [b.clone() for b in module.buffers()]))
        (out, grads, buffers), (ref_out, ref_grads, ref_buffers) = results
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5, msg=lambda m: f"call {call}: {m}")
        for grad, ref_grad in zip(grads, ref_grads):
            assert (grad is None) == (ref_grad is None)
            if grad is not None:
                torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"call {call}: {m}")
        for buffer, ref_buffer in zip(buffers, ref_buffers):
            torch.testing.assert_close(buffer, ref_buffer, rtol=1e-4, atol=1e-5)
