"""Everything the GPU issues measure, one stage per call (each fits a 10-minute command), each
stage's output to a log in the folder given:

    python -m experiments.gpu_report OUT devices   # first step's loss and gradients, CPU against CUDA, per kernel
    python -m experiments.gpu_report OUT tests     # pytest -m "gpu or triton" -n 8: the suite's CUDA tier
    python -m experiments.gpu_report OUT kernels   # benchmark_kernels: layers at both settings, branches
    python -m experiments.gpu_report OUT models    # benchmark --device cuda: dense and NSA LMs, bf16
    python -m experiments.gpu_report OUT all       # the four in turn

Each log begins with the GPU's name, torch and triton versions, and the command. On a machine
without CUDA it says so in one line and exits 2.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

STAGES = {
    "tests": [sys.executable, "-m", "pytest", "-m", "gpu or triton", "-n", "8", "-p", "no:cacheprovider", "-q"],
    "kernels": [sys.executable, "-m", "experiments.benchmark_kernels", "--lengths", "8192", "16384", "32768",
                "65536"],
    "models": [sys.executable, "-m", "experiments.benchmark", "--device", "cuda", "--precision", "bf16",
               "--models", "transformer", "nsa", "--seq", "512", "8192", "32768", "--batch", "1", "--steps", "5",
               "--override", "model.dim=512", "model.depth=6", "model.heads=8", "model.dim_head=64"],
}


def header() -> str:
    import torch
    import triton

    return f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}"


def compare_devices(kernels=("auto", "torch"), devices=("cpu", "cuda")) -> list[str]:
    """The default NSA LM's first training step (conf/model/nsa.yaml, seq 256, batch 2, fp32, seed 0),
    once on the CPU and once on CUDA per model.kernel: the loss and the worst relative gradient
    difference. The weights are the same (built on the CPU from one seed, then moved)."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from experiments.config import register

    register()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config")
    tokens = torch.randint(0, 256, (2, 257), generator=torch.Generator().manual_seed(0))
    lines = []
    for kernel in kernels:
        results = {}
        for device in devices:
            torch.manual_seed(0)
            model = instantiate(cfg.model, kernel=kernel).to(device)
            x = tokens.to(device)
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
            results[len(results)] = (loss.item(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()})
        (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results.values()
        worst = max(((gpu_grads[n] - g).norm() / g.norm().clamp(min=1e-30), n) for n, g in cpu_grads.items())
        lines.append(f"kernel={kernel}: loss {devices[0]} {cpu_loss:.9f} {devices[1]} {gpu_loss:.9f} "
                     f"(diff {gpu_loss - cpu_loss:+.2e}); "
                     f"worst relative gradient difference {worst[0]:.2e} ({worst[1]})")
    return lines


def run_stage(stage: str, out: Path) -> int:
    log = out / f"{stage}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        f.write(header() + "\n")
        if stage == "devices":
            f.write("first step of the default NSA LM, CPU against CUDA, fp32\n")
            for line in compare_devices():
                f.write(line + "\n")
            status = 0
        else:
            f.write(" ".join(STAGES[stage]) + "\n")
            f.flush()
            status = subprocess.run(STAGES[stage], stdout=f, stderr=subprocess.STDOUT).returncode
        f.write(f"[{stage}: exit {status}, {time.perf_counter() - started:.0f} s]\n")
    print(log.read_text().rstrip().splitlines()[-1], f"-> {log}")
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the logs (created)")
    parser.add_argument("stage", choices=["devices", *STAGES, "all"])
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_report: error: no CUDA device here: these stages measure a GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stages = ["devices", *STAGES] if args.stage == "all" else [args.stage]
    return max(run_stage(stage, args.out) for stage in stages)


if __name__ == "__main__":
    sys.exit(main())
