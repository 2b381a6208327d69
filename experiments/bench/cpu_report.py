"""Everything the CPU story measures (NSA against dense on every ISA, DSA, decoding, the speculative
preset), one stage per process, each stage's output to a log in the folder given:

    python -m experiments.bench.cpu_report OUT nsa8k        # NSA against dense, training step at 8k, 5 rounds (~10 min)
    python -m experiments.bench.cpu_report OUT nsa8k-avx2   # the same on AVX2 throughout (C kernels x86-64-v3, PyTorch, MKL, oneDNN)
    python -m experiments.bench.cpu_report OUT nsa32k       # at 32k, 3 rounds (25-50 min)
    python -m experiments.bench.cpu_report OUT bf16         # 8k in bf16: NSA and dense, then NSA on its PyTorch path
    python -m experiments.bench.cpu_report OUT dsa          # DSA against dense at 8k
    python -m experiments.bench.cpu_report OUT decoding     # plain decoding at the seed's size, ours and the reference's
    python -m experiments.bench.cpu_report OUT speculative  # the preset trained, then plain against speculative
    python -m experiments.bench.cpu_report OUT all          # every stage, in that order

All at the bench size, 2 threads, each figure a ratio within one run (the machines are shared).
Each log begins with the CPU as /proc/cpuinfo names it (model name, vendor, family and model: the
kind, which `lscpu` also prints; its vector ISAs), torch's version and the ISA the C kernels are
built for; then each command, its output and its exit status. A stage the CPU cannot run says why
in one line: `nsa8k-avx2` needs AVX-512, where the native build is another ISA than AVX2 (on an
AVX2-only CPU `nsa8k` measures that build already). The reference package of `decoding` is not a
dependency (`pip install speculative-decoding==0.2.0`); without it, ours alone is timed.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]  # train.py's folder: the commands run there
MODELS = [sys.executable, "-m", "experiments.bench.models", "--batch", "1"]
NSA_VS_DENSE = [*MODELS, "--models", "nsa", "transformer"]
# An AVX2-only CPU's software on this one: the C kernels built for x86-64-v3, and PyTorch's own vector
# ops, MKL's and oneDNN's products held to AVX2 as well, so dense does not keep the wider ISA that
# NSA's kernels are denied (both models' products run in MKL).
AVX2 = {"SPARSE_ATTENTION_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2"}
# (environment, command) pairs of each stage, run in turn
STAGES = {
    "nsa8k": [({}, [*NSA_VS_DENSE, "--seq", "8192", "--steps", "3", "--repeat", "5"])],
    "nsa8k-avx2": [(AVX2, [*NSA_VS_DENSE, "--seq", "8192", "--steps", "3", "--repeat", "5"])],
    "nsa32k": [({}, [*NSA_VS_DENSE, "--seq", "32768", "--steps", "2", "--repeat", "3"])],
    "bf16": [({}, [*NSA_VS_DENSE, "--seq", "8192", "--steps", "3", "--repeat", "3", "--precision", "bf16"]),
             ({}, [*MODELS, "--models", "nsa", "--seq", "8192", "--steps", "3", "--repeat", "3", "--precision", "bf16",
                   "--override", "model.kernel=torch"])],
    "dsa": [({}, [*MODELS, "--models", "dsa", "transformer", "--seq", "8192", "--steps", "3", "--repeat", "3"])],
    "decoding": [({}, [sys.executable, "-m", "experiments.bench.speculative", "--models", "ours", "ref"])],
    "speculative": [({}, [sys.executable, "train.py", "experiment=speculative", "tracker=none"]),
                    ({}, [sys.executable, "-m", "experiments.bench.speculative", "--models", "--primes", "5"])],
}
ISAS = (("AVX2", ("avx2",)), ("AVX-512", ("avx512f", "avx512_bf16", "avx512_vnni")), ("AMX", ("amx_tile", "amx_bf16")))


def cpu_identity(cpuinfo: str) -> dict:
    """The first processor of /proc/cpuinfo's text -> {name, vendor, family, model, flags (set)}."""
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return {"name": fields.get("model name", "unknown CPU"), "vendor": fields.get("vendor_id", "?"),
            "family": fields.get("cpu family", "?"), "model": fields.get("model", "?"),
            "flags": set(fields.get("flags", "").split())}


def describe(cpu: dict) -> str:
    """One line: `AMD EPYC (AuthenticAMD family 25 model 1): AVX2; no AVX-512; no AMX`, each ISA
    present with the flags of it that the kernels and PyTorch's bf16 paths can use."""
    parts = []
    for isa, flags in ISAS:
        have = [flag for flag in flags if flag in cpu["flags"]]
        parts.append(f"no {isa}" if flags[0] not in cpu["flags"] else f"{isa} ({', '.join(have)})" if len(have) > 1
                     else isa)
    return f"{cpu['name']} ({cpu['vendor']} family {cpu['family']} model {cpu['model']}): {'; '.join(parts)}"


def cannot_run(stage: str, cpu: dict) -> Optional[str]:
    """Why this CPU cannot run `stage` (one line), or None."""
    if stage == "nsa8k-avx2" and "avx512f" not in cpu["flags"]:
        detail = "this CPU's native build is AVX2 already: nsa8k measures it" if "avx2" in cpu["flags"] else \
            "this CPU has no AVX2 to build for"
        return f"nsa8k-avx2 compares an AVX2 build with an AVX-512 one: {detail}"
    return None


def header(cpu: dict, env: dict) -> str:
    """The log's first line: the CPU, torch, and the ISA the stage's settings build the C kernels for."""
    import torch

    from kernels import native

    return (f"{describe(cpu)}; {os.cpu_count()} cores seen, 2 threads; torch {torch.__version__}; "
            f"C kernels {native.isa(env.get('SPARSE_ATTENTION_MARCH'))}")


def reference_installed() -> bool:
    """Whether the decoding stage's reference package (speculative-decoding) is importable here."""
    return importlib.util.find_spec("speculative_decoding") is not None


def stage_commands(stage: str, run: Optional[Path]) -> list[tuple[dict, list[str]]]:
    """The stage's (environment, command) pairs, with the run directory the speculative preset
    trains into, and the decoding reference left out where it is not installed."""
    commands = []
    for env, command in STAGES[stage]:
        if command[1] == "train.py":
            command = [*command, f"hydra.run.dir={run}"]
        elif stage == "speculative":
            command = [*command, "--run", str(run)]
        elif stage == "decoding" and not reference_installed():
            command = [arg for arg in command if arg != "ref"]
        commands.append((env, command))
    return commands


def run_stage(stage: str, out: Path, cpu: dict) -> int:
    """The stage's commands in turn, into OUT/<stage>.log; the worst exit status."""
    log = out / f"{stage}.log"
    started = time.perf_counter()
    status = 0
    with log.open("w") as f:
        f.write(header(cpu, STAGES[stage][0][0]) + "\n")
        if reason := cannot_run(stage, cpu):
            f.write(f"not run: {reason}\n")
        else:
            if stage == "decoding" and not reference_installed():
                f.write("the reference package is not installed (pip install speculative-decoding==0.2.0): ours alone\n")
            run = Path(tempfile.mkdtemp(prefix="cpu_report_")) / "run" if stage == "speculative" else None
            for env, command in stage_commands(stage, run):
                f.write("$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *command]) + "\n")
                f.flush()
                status = max(status, subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                                    env={**os.environ, **env}).returncode)
                if status:  # the next command would measure what this one did not make
                    break
        f.write(f"[{stage}: exit {status}, {time.perf_counter() - started:.0f} s]\n")
    print(log.read_text().rstrip().splitlines()[-1], f"-> {log}")
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.cpu_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the logs (created)")
    parser.add_argument("stage", nargs="+", choices=[*STAGES, "all"])
    args = parser.parse_args(argv)
    try:
        cpu = cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        print(f"{parser.prog}: error: no /proc/cpuinfo here: the report names the CPU from it (Linux)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stages = list(STAGES) if "all" in args.stage else list(dict.fromkeys(args.stage))
    return max(run_stage(stage, args.out, cpu) for stage in stages)


if __name__ == "__main__":
    sys.exit(main())
