"""Everything the GPU issues measure, one stage per process, each stage's output to a log in the
folder given:

    python -m experiments.bench.gpu_report OUT warm      # compile --launches' Triton kernels on every core first
    python -m experiments.bench.gpu_report OUT devices   # first step's loss and gradients, CPU against CUDA, per LM
    python -m experiments.bench.gpu_report OUT tests     # pytest -m "gpu or triton" -n 8: the suite's CUDA tier
    python -m experiments.bench.gpu_report OUT kernels   # benchmark_kernels: layers at both settings, branches
    python -m experiments.bench.gpu_report OUT models    # benchmark --device cuda: dense and NSA LMs, bf16
    python -m experiments.bench.gpu_report OUT compile   # trainer.compile's modes: loss against eager, tokens/s, launches
    python -m experiments.bench.gpu_report OUT decoding  # the speculative preset trained, then its decoding engines timed
    python -m experiments.bench.gpu_report OUT warm kernels models   # several, in ORDER, each under its limit
    python -m experiments.bench.gpu_report OUT all       # every stage so

Each log begins with the GPU's name, torch and triton versions, and the command. On a machine
without CUDA it says so in one line and exits 2. With several stages, each runs in a process of its
own, and one that outlives its limit (TIMEOUTS) is killed and its log ends with a line saying so: a
hang costs one stage, not the lease; the tests and the devices stage run side by side (neither is
timed). Triton compiles each kernel the first time a process launches it, one at a time, seconds
each (H100 machine, 2026-11-27: no row of the kernels stage within 160 s, nor of the models stage
within 55 s); `warm` compiles on every core, ahead, the launches that `python -m
experiments.bench.gpu_compile --save FILE` recorded on a CPU (--launches FILE), into Triton's cache,
where the later stages find them.
"""

import argparse
import os
import signal
import subprocess
import tempfile
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from experiments.bench.agreement import first_step_agreement, lm_loss

if TYPE_CHECKING:  # torch is imported where it is used: `--help` and the no-CUDA message stay fast
    from omegaconf import DictConfig
    from torch import nn

STAGES = {
    # -v: a line per test as it ends (a stage killed at its limit still names them); -rP: what passing
    # tests print (how far two runs drift without trainer.deterministic)
    "tests": [sys.executable, "-m", "pytest", "-m", "gpu or triton", "-n", "8", "-p", "no:cacheprovider", "-v", "-rP"],
    "kernels": [sys.executable, "-m", "experiments.bench.kernels", "--repeats", "3", "--lengths", "16384", "32768",
                "65536"],
    "models": [sys.executable, "-m", "experiments.bench.models", "--device", "cuda", "--precision", "bf16",
               "--models", "transformer", "nsa", "--seq", "512", "8192", "32768", "--batch", "1", "--steps", "5",
               "--override", "model.dim=512", "model.depth=6", "model.heads=8", "model.dim_head=64"],
}


# seconds each stage may take under `all` (together under a 10-minute command, with the wheels' install)
TIMEOUTS = {"warm": 120, "kernels": 200, "models": 120, "tests": 150, "devices": 150, "compile": 130, "decoding": 120}
ORDER = [("warm",), ("kernels",), ("models",), ("tests", "devices"), ("compile",), ("decoding",)]  # a tuple: side by side
LAUNCHES = Path(".gpu/launches.json")  # warm's default input: carried to the GPU machine with the wheels


def header() -> str:
    import torch
    import triton

    return f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}"


# each LM at its conf/ size, NSA at every model.kernel (triton on the CPU side: torch, see configured_lm)
DEVICE_CHECKS = [("model=nsa", f"model.kernel={kernel}") for kernel in ("auto", "torch", "triton", "cpu")] + [
    ("model=transformer",), ("model=sinkhorn",), ("model=routing",)]


def configured_lm(*overrides: str) -> tuple[Callable[[str], "nn.Module"], "DictConfig"]:
    """(build(device), config) for the LM that `overrides` compose from conf/. NSA's kernel=triton is
    built with kernel=torch for the CPU, where Triton runs only in its interpreter."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from experiments.config import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))

    def build(device: str):
        if device == "cpu" and getattr(cfg.model.get("kernel"), "name", None) == "triton":  # an enum of the schema
            return instantiate(cfg.model, kernel="torch")
        return instantiate(cfg.model)

    return build, cfg


def compare_devices(checks: Sequence[tuple[str, ...]] = tuple(DEVICE_CHECKS),
                    devices: Sequence[str] = ("cpu", "cuda")) -> Iterator[str]:
    """One line per check, as each is done: the first training step of that LM (data.seq_len tokens,
    batch 2, fp32, seed 0) on both devices, its losses and the worst relative gradient difference; a
    check that fails gives a line starting FAILED, and the next one runs."""
    for overrides in checks:
        name = " ".join(overrides)
        try:
            build, cfg = configured_lm(*overrides)
            train = cfg.model._target_ != "models.lm.sinkhorn_lm"  # Gumbel-Sinkhorn draws noise in training
            a = first_step_agreement(build, lm_loss(cfg.model.num_tokens, cfg.data.seq_len), devices, train=train)
        except Exception as error:  # one model's failure is a finding; the others still get measured
            yield f"FAILED {name}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            continue
        yield (f"{name}{'' if train else ' (eval mode)'}: loss {devices[0]} {a.losses[0]:.9f} {devices[1]} "
               f"{a.losses[1]:.9f} (diff {a.losses[1] - a.losses[0]:+.2e}); "
               f"worst relative gradient difference {a.gradient:.2e} ({a.parameter})")


# the LM the compile stage steps: the models stage's 6 x 512 at 512 tokens, batch 1, bf16
COMPILE_LM = ("model.dim=512", "model.depth=6", "model.heads=8", "model.dim_head=64")


def compiled_steps(overrides: Sequence[str], mode: str, seq: int = 512, steps: int = 20, device: str = "cuda") -> dict:
    """Training steps of one LM as train.py takes them (trainer.compile's torch.compile of the
    forward, bf16 autocast, AdamW) on CUDA, from seed 0 on fixed random batches [1, seq + 1]:
    the first step's seconds (compiling), the losses, tokens/s over the last `steps` steps, and one
    step's launch calls and kernels (torch.profiler: a replayed CUDA graph is one launch call; on
    the CPU, where nothing is launched, none)."""
    import torch
    import torch.nn.functional as F

    from experiments.bench.measure import cuda_launches

    build, cfg = configured_lm(*overrides, f"data.seq_len={seq}")
    torch.manual_seed(0)
    model = build("cpu").to(device).train()
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    forward = model if mode == "eager" else torch.compile(model, mode=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.randint(0, cfg.model.num_tokens, (4, 1, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []

    def step(i: int) -> None:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        x = batches[i % len(batches)]
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(forward(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    started = time.perf_counter()
    step(0)
    first_s = time.perf_counter() - started
    for i in range(1, 4):
        step(i)
    sync()
    started = time.perf_counter()
    for i in range(4, 4 + steps):
        step(i)
    sync()
    tokens_per_s = steps * seq / (time.perf_counter() - started)
    launches, kernels = cuda_launches(lambda: step(4 + steps)) if device == "cuda" else (None, None)
    return dict(first_s=first_s, losses=losses, tokens_per_s=tokens_per_s, launches=launches, kernels=kernels)


COMPILE_CHECKS = [("model=nsa", *COMPILE_LM), ("model=transformer", *COMPILE_LM)]


def compare_compiled(checks: Sequence[tuple[str, ...]] = tuple(COMPILE_CHECKS),
                     modes: Sequence[str] = ("eager", "default", "reduce-overhead")) -> Iterator[str]:
    """One line per LM and trainer.compile mode, as each is done; the losses of the first 10 steps
    against eager's (bf16: expect differences of 1e-2 relative at most)."""
    for overrides in checks:
        eager = None
        for mode in modes:
            name = f"{overrides[0]} {mode}"
            try:
                r = compiled_steps(overrides, mode)
            except Exception as error:  # a mode that fails is a finding; the next one runs
                yield f"FAILED {name}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                continue
            eager = r if mode == "eager" else eager
            drift = "" if eager is None else "; worst relative loss difference to eager over 10 steps " + format(
                max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:10], eager["losses"][:10])), ".2e")
            yield (f"{name}: first step {r['first_s']:.1f} s, {r['tokens_per_s']:,.0f} tokens/s, launch calls a step "
                   f"{r['launches']} ({r['kernels']} kernels), loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
                   + drift)


DECODING = [
    # the preset, trained on CUDA (task.engine=auto: CUDA graphs): its summary holds the speedup
    [sys.executable, "train.py", "experiment=speculative", "tracker=none", "trainer.device=cuda"],
    # plain decoding at the seed's size: CUDA graphs, then the growing cache
    [sys.executable, "-m", "experiments.bench.speculative", "--models", "ours", "--device", "cuda", "--repeat",
     "1", "--engine", "graphs"],
    [sys.executable, "-m", "experiments.bench.speculative", "--models", "ours", "--device", "cuda", "--repeat",
     "1", "--engine", "cache"],
]


def decoding(log) -> int:
    """The speculative preset trained into a fresh run directory and its summary's figures, then
    plain decoding at the seed's size timed with CUDA graphs and with the growing cache."""
    run = Path(tempfile.mkdtemp(prefix="speculative_")) / "run"
    status = 0
    for command in DECODING:
        command = command + ([f"hydra.run.dir={run}"] if command[1] == "train.py" else [])
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        status = max(status, subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode)
        if command[1] == "train.py":
            summary = run / "summary.json"
            log.write(f"summary: {summary.read_text() if summary.exists() else 'none written'}\n")
    return status


def run_stage(stage: str, out: Path, launches: Path = LAUNCHES) -> int:
    log = out / f"{stage}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        f.write(header() + "\n")
        if stage in ("devices", "compile"):
            f.write("first training step of each LM at its conf/ size, CPU against CUDA, fp32\n" if stage == "devices"
                    else f"training steps at 512 tokens, batch 1, bf16 ({' '.join(COMPILE_LM)}), per trainer.compile mode\n")
            status = 0
            for line in compare_devices() if stage == "devices" else compare_compiled():
                f.write(line + "\n")
                f.flush()
                status = max(status, int(line.startswith("FAILED")))
        elif stage == "decoding":
            status = decoding(f)
        elif stage == "warm":
            command = [sys.executable, "-m", "experiments.bench.gpu_compile", "--warm", str(launches)]
            f.write(" ".join(command) + "\n")
            f.flush()
            status = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
        else:
            f.write(" ".join(STAGES[stage]) + "\n")
            f.flush()
            status = subprocess.run(STAGES[stage], stdout=f, stderr=subprocess.STDOUT).returncode
        f.write(f"[{stage}: exit {status}, {time.perf_counter() - started:.0f} s]\n")
    print(log.read_text().rstrip().splitlines()[-1], f"-> {log}")
    return status


def run_all(out: Path, stages: Sequence[str], launches: Path = LAUNCHES) -> int:
    """The stages named, in ORDER, each a process of its own killed (with its children) at its limit."""
    status = 0
    for group in ORDER:
        group = [stage for stage in group if stage in stages]
        began = time.monotonic()
        started = {stage: subprocess.Popen([sys.executable, "-m", "experiments.bench.gpu_report", str(out), stage,
                                            "--launches", str(launches)], start_new_session=True) for stage in group}
        for stage, process in started.items():
            try:
                status = max(status, process.wait(timeout=max(1.0, began + TIMEOUTS[stage] - time.monotonic())))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                with (out / f"{stage}.log").open("a") as f:
                    f.write(f"[{stage}: killed at its limit of {TIMEOUTS[stage]} s]\n")
                print(f"[{stage}: killed at its limit of {TIMEOUTS[stage]} s] -> {out / f'{stage}.log'}")
                status = max(status, 124)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.gpu_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the logs (created)")
    parser.add_argument("stage", nargs="+", choices=[*TIMEOUTS, "all"])
    parser.add_argument("--launches", type=Path, default=LAUNCHES, help="the warm stage's launches (gpu_compile --save)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"{parser.prog}: error: no CUDA device here: these stages measure a GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == ["all"] or len(args.stage) > 1:
        return run_all(args.out, list(TIMEOUTS) if "all" in args.stage else args.stage, args.launches)
    return run_stage(args.stage[0], args.out, args.launches)


if __name__ == "__main__":
    sys.exit(main())
