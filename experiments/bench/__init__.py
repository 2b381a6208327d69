"""The benchmarks, each a command with `main(argv)`, and the library they share:

    models.py       python -m experiments.bench.models: training step and decoding per model (tokens/s, memory, MFU)
    kernels.py      python -m experiments.bench.kernels: one NSA layer and its branches against dense; --count
    speculative.py  python -m experiments.bench.speculative: plain and speculative decoding, beside the reference
    dalle.py        python -m experiments.bench.dalle: DALL-E training speed beside dalle-pytorch
    gpu_report.py   python -m experiments.bench.gpu_report OUT STAGE: everything a lent GPU measures, by stage
    gpu_compile.py  python -m experiments.bench.gpu_compile: each Triton kernel compiled for a GPU, its resources

    measure.py      timing and measuring: medians of timed calls, peaks, ceilings, rounds in fresh processes
    agreement.py    one first training step on two devices, compared
    layers.py       the kernel benchmark's settings (shapes and NSA knobs) and the layers they build
    counts.py       what one layer launches, counted on the CUDA code path (any machine), and its table
    roofline.py     each branch's and each layer's work (FLOPs, bytes) and the time a GPU's limits allow
"""
