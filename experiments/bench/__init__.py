"""The library under experiments/benchmark_kernels.py's command line, for it and for tests:

    layers.py    the settings (shapes and NSA knobs) and the layers they build: dense GQA, NSA
    counts.py    what one layer launches, counted on the CUDA code path (any machine), and its table
    roofline.py  each branch's and each layer's work (FLOPs, bytes) and the time a GPU's limits allow
"""
