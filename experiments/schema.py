"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each yaml option in conf/<group>/ starts from its schema here
(`defaults: [/schema/<group>/<name>@_here_, _self_]`), so a
misspelt key or a value of the wrong type fails at composition, naming the key, before any work.
Rules a type cannot express live in `experiments.checks` (the trainer's) and in each model's
constructor (its knobs), and are checked before training starts.

This module imports only hydra/omegaconf: train.py imports it before composing, and `--help`
must stay fast.
"""

import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Kernel(Enum):
    auto = "auto"
    torch = "torch"
    triton = "triton"


class WandbMode(Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class TrainerConfig:
    max_steps: int = 300
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    validate_every: int = 100  # steps; 0 disables (the final validation still runs)
    val_batches: int = 8  # micro-batches per validation, always the same crops
    generate_every: int = 0  # steps; 0: only at the end
    checkpoint_every: int = 100  # steps; a checkpoint is also written at the end
    keep_checkpoints: int = 1  # how many of the newest checkpoints to keep
    log_every: int = 10  # steps between metrics.jsonl rows
    seed: int = 0
    device: Device = Device.auto
    precision: Precision = Precision.fp32
    clip_grad_norm: Optional[float] = 1.0  # null: no clipping
    resume: str = "auto"  # auto | never | <checkpoint file or run directory>
    threads: Optional[int] = None  # torch intra-op threads on CPU; null: torch's default
    progress: bool = True  # tqdm progress bar on stderr


@dataclass
class Config:
    """The root: groups are typed by their own schemas below, the trainer section here."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    schedule: Any = MISSING
    backend: Any = MISSING
    tracker: Any = MISSING
    task: Any = MISSING
    draft: Any = None  # a second model (speculative decoding's draft): `- /model@draft: <option>`
    vae: Any = None  # DALL-E's discrete VAE: `- /model@vae: dvae`


# ---- model ---------------------------------------------------------------------------------


@dataclass
class TransformerConfig:
    """The shared backbone's knobs; every attention variant adds its own."""

    _target_: str = "models.lm.transformer_lm"
    num_tokens: int = 256
    dim: int = 256
    depth: int = 4
    heads: int = 4
    dim_head: int = 64
    ff_mult: float = 4.0
    ff_chunks: int = 1  # the feed-forward runs on this many slices of the sequence in turn
    emb_dim: Optional[int] = None  # a factorised token embedding of this width; null: dim
    reversible: bool = False  # reversible residual layers: activation memory flat in depth
    attn_dropout: float = 0.0
    ff_dropout: float = 0.0


@dataclass
class NSAConfig(TransformerConfig):
    _target_: str = "models.lm.nsa_lm"
    kv_heads: int = 2
    sliding_window_size: int = 64
    compress_block_size: int = 16
    compress_stride: int = 8
    fine_block_size: int = 16
    num_fine_selected: int = 4
    compress_hidden_mult: float = 1.0  # hidden width of the compression MLP, in dim_head units
    diff_topk: bool = False  # selection passes gradient to the compressed keys (straight-through)
    kernel: Kernel = Kernel.auto


@dataclass
class SinkhornConfig(TransformerConfig):
    _target_: str = "models.lm.sinkhorn_lm"
    bucket_size: int = 64
    n_local_attn_heads: Any = 0  # an int, or one int per layer
    sinkhorn_iter: int = 5
    temperature: float = 0.75


@dataclass
class RoutingConfig(TransformerConfig):
    _target_: str = "models.lm.routing_lm"
    window_size: int = 64
    num_clusters: int = 8
    n_local_attn_heads: Any = 0  # an int, or one int per layer, e.g. [8, 8, 8, 8, 4, 4, 2, 2]
    ema_decay: float = 0.99  # of the k-means centroids, per optimizer step
    commitment_weight: float = 1e-4


@dataclass
class DiscreteVAEConfig:
    _target_: str = "models.dvae.DiscreteVAE"
    image_size: int = 32
    num_tokens: int = 512  # codebook size: DALL-E's image vocabulary
    codebook_dim: int = 256
    num_layers: int = 2  # each halves the resolution: codes on a (image_size / 2**num_layers)^2 grid
    num_resnet_blocks: int = 0
    hidden_dim: int = 64
    channels: int = 3
    temperature: float = 0.9  # Gumbel-softmax temperature at step 0 ...
    temperature_min: float = 0.0625  # ... annealed to this: max(min, t0 * exp(-anneal_rate * step))
    anneal_rate: float = 0.0
    kl_weight: float = 0.0
    straight_through: bool = False


@dataclass
class DalleConfig:
    """The text-to-image transformer. Its vocabularies and lengths come from the data (tokenizer,
    text_seq_len) and the VAE (num_tokens, grid), so it is built by the task (`_partial_`)."""

    _target_: str = "models.dalle.DALLE"
    _partial_: bool = True
    dim: int = 256
    depth: int = 4
    heads: int = 4
    dim_head: int = 64
    ff_mult: float = 4.0
    attn_dropout: float = 0.0
    ff_dropout: float = 0.0
    attn_types: list = field(default_factory=lambda: ["full"])  # cycled over the layers
    kernel_size: int = 5  # of conv_like attention
    sparse_options: dict = field(default_factory=dict)  # {nsa|sinkhorn|routing: {knob: value}}
    shared_attn_ids: Optional[list] = None  # layers with equal ids share their attention
    shared_ff_ids: Optional[list] = None
    share_input_output_emb: bool = False
    rotary_emb: bool = True
    shift_tokens: bool = False  # each attention also reads the previous token and the code above
    loss_img_weight: float = 7.0
    cond_drop_prob: float = 0.0  # > 0 trains for classifier-free guidance (task.cond_scale)
    reversible: bool = False


# ---- data ----------------------------------------------------------------------------------


@dataclass
class ShapesDataConfig:
    """Generated captioned images: one coloured shape each (nothing downloaded)."""

    _target_: str = "experiments.shapes.Shapes"
    image_size: int = 32
    text_seq_len: int = 16


@dataclass
class ImageFolderDataConfig:
    """Images with same-stem .txt captions, or WebDataset-style .tar shards (experiments/image_text.py)."""

    _target_: str = "experiments.image_text.ImageTextFolder"
    path: str = MISSING
    image_size: int = 64
    text_seq_len: int = 64
    resize_ratio: float = 0.75  # random resized crops keep this much of the area, or more
    truncate_captions: bool = False  # false: a caption longer than text_seq_len is an error
    val_fraction: float = 0.05
    channels: int = 3
    tokenizer: str = "bytes"  # bytes, or a trained BPE: the path of a `tokenizers` JSON file


@dataclass
class TextDataConfig:
    """Byte-level text: the built-in corpus, or any file through `path`."""

    _target_: str = "experiments.data.ByteText"
    seq_len: int = 256
    path: Optional[str] = None  # null: the built-in corpus (this Python's standard library)
    val_fraction: float = 0.1  # the validation split is taken from the end
    cache_dir: str = "${oc.env:XDG_CACHE_HOME,${oc.env:HOME,.}/.cache}/sparse-attention"


@dataclass
class Enwik8DataConfig:
    _target_: str = "experiments.data.Enwik8"
    seq_len: int = 512
    path: str = "data/enwik8.gz"
    train_bytes: int = 90_000_000
    val_bytes: int = 5_000_000


# ---- optimizer and schedule (partials: parameters and optimizer are bound by the task) -----


@dataclass
class AdamConfig:
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = 1e-3
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class AdamWConfig(AdamConfig):
    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01


@dataclass
class CosineScheduleConfig:
    _target_: str = "experiments.schedule.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = 50
    total_steps: int = "${trainer.max_steps}"  # type: ignore[assignment]
    min_lr_ratio: float = 0.1


@dataclass
class PlateauScheduleConfig:
    """The DALL-E seed's lr_decay: halve the lr when the training loss stops falling."""

    _target_: str = "experiments.schedule.plateau"
    _partial_: bool = True
    window: int = 100  # steps per judged "epoch" (the mean loss of the window)
    factor: float = 0.5
    patience: int = 10
    cooldown: int = 10
    min_lr: float = 1e-6


@dataclass
class ConstantScheduleConfig:
    _target_: str = "experiments.schedule.constant"
    _partial_: bool = True
    warmup_steps: int = 0


# ---- backend, tracker, task ----------------------------------------------------------------


@dataclass
class LocalBackendConfig:
    _target_: str = "experiments.backends.LocalBackend"


@dataclass
class DDPBackendConfig:
    _target_: str = "experiments.backends.DDPBackend"
    timeout_s: float = 600.0  # a collective waiting longer for a dead rank fails the job
    find_unused_parameters: bool = False


@dataclass
class DeepSpeedBackendConfig:
    _target_: str = "experiments.backends.DeepSpeedBackend"
    zero_stage: int = 0  # 0-3
    offload_optimizer: str = "none"  # none | cpu | nvme (ZeRO >= 1)
    offload_param: str = "none"  # none | cpu | nvme (ZeRO 3)
    initial_loss_scale_power: int = 16  # fp16: dynamic loss scaling starts at 2^this
    config_file: Optional[str] = None  # a DeepSpeed JSON to start from; the trainer's keys win
    timeout_s: float = 600.0


@dataclass
class NoTrackerConfig:
    """What names a run, whichever tracker records it (presets set these; `none` ignores them)."""

    _target_: str = "experiments.trackers.NoTracker"
    project: str = "sparse-attention"
    name: Optional[str] = None  # null: the job's overrides, or the run directory's name
    group: Optional[str] = None  # null: the sweep directory for sweep jobs
    tags: list = field(default_factory=list)


@dataclass
class WandbConfig(NoTrackerConfig):
    _target_: str = "experiments.trackers.WandbTracker"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode.offline  # offline never needs the network; `wandb sync` later


@dataclass
class LanguageModelTaskConfig:
    _target_: str = "experiments.language_model.LanguageModelTask"
    prime_length: int = 64  # bytes of validation text that prime each sample
    generate_length: int = 256
    num_samples: int = 1
    temperature: float = 1.0
    top_k: Optional[int] = 32  # null: the full distribution
    randomly_truncate_sequence: bool = False  # each training row keeps a random length (routing seed)


@dataclass
class SpeculativeTaskConfig(LanguageModelTaskConfig):
    _target_: str = "experiments.speculative.SpeculativeTask"
    gamma: int = 5  # draft tokens per verification step
    temperature: float = 0.0  # 0: greedy, which speculative decoding reproduces token for token


@dataclass
class DiscreteVAETaskConfig:
    _target_: str = "experiments.text_to_image.DiscreteVAETask"
    num_samples: int = 8  # validation images shown over their reconstructions


@dataclass
class DalleTaskConfig:
    _target_: str = "experiments.text_to_image.TextToImageTask"
    vae_path: Optional[str] = None  # a trained VAE: a dvae or dalle run (or checkpoint); null: train `vae` first
    vae_steps: int = 1000  # the VAE stage before DALL-E's trainer.max_steps (none with vae_path)
    vae_lr: float = 3e-3
    num_samples: int = 32  # validation captions drawn at each generation
    temperature: float = 1.0
    filter_thres: float = 0.9  # sample from the top (1 - filter_thres) of the image logits
    cond_scale: float = 1.0  # classifier-free guidance (needs model.cond_drop_prob > 0)


def job_subdir(task_overrides: Any, seed: Any, sweeper_params: Any = None, job_num: Any = None) -> str:
    """A sweep job's directory: the values of the swept keys (not every override on the command
    line), then the seed as its own last level, e.g. `model.num_fine_selected=4/seed=1`. A sweeper
    that picks values itself (Optuna) may pick the same ones twice, so its jobs lead with
    `trial=<job number>`."""
    swept = _swept_keys(sys.argv[1:])
    if swept is not None and sweeper_params:
        swept |= set(sweeper_params)
    parts = sorted(
        o.replace("/", "_") for o in task_overrides
        if (key := o.split("=", 1)[0].lstrip("+~")) != "trainer.seed" and (swept is None or key in swept)
    )
    if sweeper_params:
        parts.insert(0, f"trial={job_num}")
    name = ",".join(parts)
    return f"{name}/seed={seed}" if name else f"seed={seed}"


def _swept_keys(args: list[str]) -> Optional[set[str]]:
    """Keys given several values on the command line (None if it cannot be parsed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:
        return None
    return {o.key_or_group for o in overrides if o.is_sweep_override()}


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(group="schema", name="config", node=Config)
    schemas = {
        "model": {"transformer": TransformerConfig, "nsa": NSAConfig, "sinkhorn": SinkhornConfig,
                  "routing": RoutingConfig, "dvae": DiscreteVAEConfig, "dalle": DalleConfig},
        "data": {"text": TextDataConfig, "enwik8": Enwik8DataConfig, "shapes": ShapesDataConfig,
                 "image_folder": ImageFolderDataConfig},
        "optimizer": {"adam": AdamConfig, "adamw": AdamWConfig},
        "schedule": {"cosine": CosineScheduleConfig, "constant": ConstantScheduleConfig,
                     "plateau": PlateauScheduleConfig},
        "backend": {"local": LocalBackendConfig, "ddp": DDPBackendConfig, "deepspeed": DeepSpeedBackendConfig},
        "tracker": {"wandb": WandbConfig, "none": NoTrackerConfig},
        "task": {"lm": LanguageModelTaskConfig, "speculative": SpeculativeTaskConfig,
                 "dvae": DiscreteVAETaskConfig, "dalle": DalleTaskConfig},
    }
    for group, options in schemas.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
    OmegaConf.register_new_resolver("job_subdir", job_subdir, replace=True)


register()
