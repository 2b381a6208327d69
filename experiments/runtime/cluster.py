"""A SLURM sweep checked against the cluster before any job is submitted (docs/cluster.md).

`SlurmPreflight` is a Hydra callback (conf/config.yaml's hydra.callbacks). When a multirun uses the
submitit SLURM launcher (hydra/launcher=slurm), before the sweep directory is made it:
- refuses in one line where `sbatch` or `sinfo` is missing, or the controller cannot be reached;
- refuses a partition the cluster does not have, naming hydra.launcher.partition (null takes the
  cluster's default partition);
- drops the default GPU options (gpus_per_node, gpus_per_task) where no node of the partition has a
  GPU, and fits the default cpus_per_task and mem_gb to the partition's largest node, with one line
  saying so (defaults: conf/hydra/launcher/slurm.yaml's; values given on the command line are never
  changed): the defaults ask for a GPU node, and a newcomer's first sweep on a small CPU cluster
  should run, not fail in sbatch;
- asks the scheduler (`sbatch --test-only` on the batch script submitit would submit) whether it
  would accept the jobs, and refuses with the scheduler's own reason if not (more CPUs or memory
  than a node has, an unknown account or QOS).

Only the standard library and Hydra are imported at module level; submitit only where the launcher
is SLURM.
"""

import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional

from hydra.experimental.callback import Callback

GPU_KEYS = ("gpus_per_node", "gpus_per_task")


class SlurmPreflight(Callback):
    """Hydra callback: see the module's docstring."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        launcher = config.hydra.launcher
        if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
            return
        given = {o.split("=", 1)[0].lstrip("+~") for o in config.hydra.overrides.hydra}
        if error := check_launcher(launcher, {k.removeprefix("hydra.launcher.") for k in given}):
            sys.exit(f"error: {error}")


def _sinfo(*args: str) -> tuple[Optional[str], str]:
    """(output, "") or (None, why sinfo failed in one line)."""
    try:
        result = subprocess.run(["sinfo", "-h", *args], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None, ("sinfo did not answer in 30 s, so the SLURM cluster cannot be asked about the jobs: is its "
                      "controller reachable from here (`scontrol ping`; SLURM_CONF names the cluster's slurm.conf)?")
    except OSError as e:
        return None, f"sinfo could not run: {e}"
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["exit status %d" % result.returncode])[-1]
        return None, f"sinfo failed, so the SLURM cluster cannot be asked about the jobs: {reason}"
    return result.stdout, ""


def partitions() -> tuple[Optional[dict], str]:
    """{partition: [(cpus, memory_mb, gres), ...] per node}, the default partition first; or
    (None, why not)."""
    out, error = _sinfo("-N", "-o", "%P|%c|%m|%G")
    if out is None:
        return None, error
    found: dict = {}
    default = None
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        name, cpus, mem, gres = parts
        if name.endswith("*"):
            name = default = name[:-1]
        found.setdefault(name, []).append((_int(cpus), _int(mem), gres))
    if default is not None:
        found = {default: found.pop(default), **found}
    return found, ""


def _int(text: str) -> int:
    digits = "".join(ch for ch in text if ch.isdigit())
    return int(digits) if digits else 0


def has_gpus(nodes: list) -> bool:
    return any("gpu" in gres.lower() for _, _, gres in nodes)


def check_launcher(launcher: Any, given: frozenset = frozenset()) -> Optional[str]:
    """Why the sweep cannot be submitted as configured, in one line; None when it can. Drops the GPU
    options in `launcher` where the partition has no GPUs and fits the resources not `given` on the
    command line to its largest node."""
    for command in ("sbatch", "sinfo"):
        if shutil.which(command) is None:
            return (f"hydra/launcher=slurm submits the sweep with sbatch, but `{command}` is not installed here: "
                    "run it on a machine of the SLURM cluster (docs/cluster.md), or sweep here without "
                    "hydra/launcher=slurm")
    found, error = partitions()
    if found is None:
        return error
    if not found:
        return "sinfo lists no partition: the SLURM cluster has no nodes to run the sweep on"
    partition = launcher.get("partition")
    asked = str(partition).split(",") if partition is not None else []  # sbatch takes a list
    if unknown := [p for p in asked if p not in found]:
        return (f"hydra.launcher.partition={partition}: the SLURM cluster has no partition {', '.join(unknown)} "
                f"(it has: {', '.join(found)}; null takes the default, {next(iter(found))})")
    name = asked[0] if asked else next(iter(found))
    changes = {}
    if not has_gpus(found[name]):
        changes.update({k: None for k in GPU_KEYS if launcher.get(k) and k not in given})
    node_cpus = max(c for c, _, _ in found[name])
    cpus = node_cpus // max(1, int(launcher.get("tasks_per_node") or 1))
    if "cpus_per_task" not in given and cpus and (launcher.get("cpus_per_task") or 0) > cpus:
        changes["cpus_per_task"] = cpus
    mem_gb = max(m for _, m, _ in found[name]) // 1024
    if "mem_gb" not in given and (launcher.get("mem_gb") or 0) > mem_gb:
        changes["mem_gb"] = mem_gb or None
    if changes:
        from omegaconf import open_dict, read_write

        what = ", ".join(f"hydra.launcher.{k}={launcher.get(k)} -> {v}" for k, v in changes.items())
        with read_write(launcher), open_dict(launcher):
            for key, value in changes.items():
                launcher[key] = value
        gpus = "GPUs" if has_gpus(found[name]) else "no GPUs"
        print(f"note: partition {name} has {gpus} and nodes of at most {node_cpus} CPUs and {mem_gb} GB: the "
              f"launcher's defaults fitted to it: {what}", file=sys.stderr)
    return scheduler_refusal(launcher)


def scheduler_refusal(launcher: Any) -> Optional[str]:
    """The scheduler's reason for refusing the batch script submitit would submit (`sbatch
    --test-only`), or None when it would accept it."""
    from omegaconf import OmegaConf

    params = {k: v for k, v in OmegaConf.to_container(launcher, resolve=True).items() if k != "_target_"}
    with tempfile.TemporaryDirectory() as folder:
        try:
            script = batch_script(params, folder)
        except (TypeError, ValueError) as e:  # a value submitit itself refuses
            return f"hydra.launcher: {e}"
        path = f"{folder}/preflight.sh"
        with open(path, "w") as f:
            f.write(script)
        try:
            result = subprocess.run(["sbatch", "--test-only", path], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"sbatch --test-only did not answer: {e}"
    if result.returncode == 0:
        return None
    reason = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    reason = reason.removeprefix("sbatch: error: ").removeprefix("Batch job submission failed: ")
    shown = " ".join(f"{k}={params[k]}" for k in ("partition", "nodes", "tasks_per_node", "cpus_per_task",
                                                     "gpus_per_node", "mem_gb", "timeout_min", "account", "qos")
                     if params.get(k) is not None)
    return f"the SLURM cluster refuses the sweep's jobs: {reason} (hydra.launcher: {shown})"


def batch_script(params: dict, folder: str) -> str:
    """The sbatch script hydra-submitit-launcher would submit for one job with these launcher
    parameters (its own conversion: hydra_plugins/hydra_submitit_launcher/submitit_launcher.py)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    init = {"folder": folder}
    if "max_num_timeout" in params:
        init["slurm_max_num_timeout"] = params["max_num_timeout"]
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    rest = {k if k in base else f"slurm_{k}": v for k, v in params.items()
            if k not in ("submitit_folder", "max_num_timeout")}
    executor = submitit.AutoExecutor(cluster="slurm", **init)
    executor.update_parameters(**rest)
    return executor._executor._make_submission_file_text("true", "preflight")  # noqa: SLF001
