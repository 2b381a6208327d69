"""Typed schemas for every config group, registered in Hydra's ConfigStore by `register()`.

The schemas own the types and what each key means; the yaml files in conf/ own every value (no
field here has a default: tests/experiments/config/test_values.py holds both rules). Each yaml option in
conf/<group>/ starts from its schema (`defaults: [/<group>_<name>_schema@_here_, _self_]`), so a
misspelt key or a value of the wrong type fails at composition, naming the key, before any work.
Rules a type cannot express live in `experiments.config.checks` (the trainer's) and in each model's
constructor (its knobs), and are checked before training starts.

This module imports only hydra/omegaconf: train.py imports it before composing, and `--help`
must stay fast.
"""

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from experiments.config.resolvers import from_dense, job_subdir


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class CpuAllocator(Enum):
    system = "system"
    caching = "caching"
    pooled = "pooled"


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Kernel(Enum):
    auto = "auto"
    torch = "torch"
    triton = "triton"
    cpu = "cpu"


class Compressor(Enum):  # NSA's compressed branch: a learned MLP, or InfLLM-v2's parameter-free mean
    mlp = "mlp"
    mean = "mean"


class WarmupTrains(Enum):  # what DSA's dense warm-up trains
    indexer = "indexer"
    all = "all"


class Branch(Enum):  # NSA's three branches
    compressed = "compressed"
    selected = "selected"
    window = "window"


class DecodingEngine(Enum):  # speculative decoding's decoders: models/decoding.py ENGINES, or auto
    auto = "auto"
    cache = "cache"
    static = "static"
    compiled = "compiled"
    graphs = "graphs"


class WandbMode(Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class TrainerConfig:
    max_steps: int = MISSING
    batch_size: int = MISSING  # sequences per micro-batch
    grad_accum: int = MISSING  # micro-batches per optimizer step
    validate_every: int = MISSING  # steps; 0 disables (the final validation still runs)
    val_batches: int = MISSING  # micro-batches per validation, always the same crops
    generate_every: int = MISSING  # steps; 0: only at the end
    checkpoint_every: int = MISSING  # steps; a checkpoint is also written at the end
    keep_checkpoints: int = MISSING  # how many of the newest checkpoints to keep
    log_every: int = MISSING  # steps between metrics.jsonl rows
    seed: int = MISSING
    device: Device = MISSING
    precision: Precision = MISSING
    clip_grad_norm: Optional[float] = MISSING  # null: no clipping
    resume: str = MISSING  # auto | never | <checkpoint file or run directory>
    init_from: Optional[str] = MISSING  # a run directory or checkpoint whose matching weights start a new run
    init_strict: bool = MISSING  # false: a weight whose shape differs is dropped (starts afresh), not refused
    threads: Optional[int] = MISSING  # torch intra-op threads on CPU; null: torch's default
    cpu_allocator: CpuAllocator = MISSING  # freed memory: back to the system, kept on the heap, or pooled by size
    progress: bool = MISSING  # tqdm progress bar on stderr
    # torch.compile of each trained model's training forward: false | default | reduce-overhead (CUDA
    # graphs, CUDA only); true means default. Any: a bool or a mode name, checked by experiments.config.checks
    compile: Any = MISSING
    deterministic: bool = MISSING  # deterministic algorithms only: GPU runs repeat to the bit


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
    num_tokens: int = MISSING
    dim: int = MISSING
    depth: int = MISSING
    heads: int = MISSING
    dim_head: int = MISSING
    ff_mult: float = MISSING
    ff_chunks: int = MISSING  # the feed-forward runs on this many slices of the sequence in turn
    emb_dim: Optional[int] = MISSING  # a factorised token embedding of this width; null: dim
    reversible: bool = MISSING  # reversible residual layers: activation memory flat in depth
    attn_dropout: float = MISSING
    ff_dropout: float = MISSING


@dataclass
class NSAConfig(TransformerConfig):
    _target_: str = "models.lm.nsa_lm"
    kv_heads: int = MISSING
    sliding_window_size: int = MISSING
    compress_block_size: int = MISSING
    compress_stride: int = MISSING
    fine_block_size: int = MISSING
    num_fine_selected: int = MISSING
    compressor: Compressor = MISSING  # mlp (the paper's) | mean (InfLLM-v2's: no parameters)
    compress_hidden_mult: float = MISSING  # hidden width of the compression MLP, in dim_head units
    diff_topk: bool = MISSING  # selection passes gradient to the compressed keys (straight-through)
    branches: list[Branch] = MISSING  # the branches whose gates are free; the others held at 0 (ablations)
    gate_bias: list[float] = MISSING  # a fixed offset of each branch's gate logit (ablations: gates start open/closed)
    shared_kv: bool = MISSING  # one key/value projection for the three branches (an ablation)
    kernel: Kernel = MISSING


@dataclass
class SinkhornConfig(TransformerConfig):
    _target_: str = "models.lm.sinkhorn_lm"
    bucket_size: int = MISSING
    n_local_attn_heads: Any = MISSING  # an int, or one int per layer
    sinkhorn_iter: int = MISSING
    temperature: float = MISSING


@dataclass
class RoutingConfig(TransformerConfig):
    _target_: str = "models.lm.routing_lm"
    window_size: int = MISSING
    num_clusters: int = MISSING
    n_local_attn_heads: Any = MISSING  # an int, or one int per layer, e.g. [8, 8, 8, 8, 4, 4, 2, 2]
    ema_decay: float = MISSING  # of the k-means centroids, per optimizer step
    commitment_weight: float = MISSING


@dataclass
class MoBAConfig(TransformerConfig):
    _target_: str = "models.lm.moba_lm"
    kv_heads: int = MISSING
    block_size: int = MISSING  # keys per block: the unit the gate chooses
    top_k: int = MISSING  # blocks per query, its own block counted
    include_own_block: bool = MISSING  # the query's own block always attended (causally), as the paper
    kernel: Kernel = MISSING


@dataclass
class DSAConfig(TransformerConfig):
    _target_: str = "models.lm.dsa_lm"
    kv_heads: int = MISSING
    index_heads: int = MISSING  # the lightning indexer's heads
    index_dim_head: int = MISSING  # their width (one indexer key per token)
    top_k: int = MISSING  # tokens each query attends to
    warmup_steps: int = MISSING  # optimizer steps of dense attention while the indexer learns to match it
    kl_weight: float = MISSING  # of the indexer's KL loss (it trains the indexer alone)
    warmup_trains: WarmupTrains = MISSING  # indexer: the rest frozen during warm-up (the report's); all: everything
    kernel: Kernel = MISSING


@dataclass
class DiscreteVAEConfig:
    _target_: str = "models.dvae.DiscreteVAE"
    image_size: int = MISSING
    num_tokens: int = MISSING  # codebook size: DALL-E's image vocabulary
    codebook_dim: int = MISSING
    num_layers: int = MISSING  # each halves the resolution: codes on a (image_size / 2**num_layers)^2 grid
    num_resnet_blocks: int = MISSING
    hidden_dim: int = MISSING
    channels: int = MISSING
    temperature: float = MISSING  # Gumbel-softmax temperature at step 0 ...
    temperature_min: float = MISSING  # ... annealed to this: max(min, t0 * exp(-anneal_rate * step))
    anneal_rate: float = MISSING
    kl_weight: float = MISSING
    straight_through: bool = MISSING


@dataclass
class DalleConfig:
    """The text-to-image transformer. Its vocabularies and lengths come from the data (tokenizer,
    text_seq_len) and the VAE (num_tokens, grid), so it is built by the task (`_partial_`)."""

    _target_: str = "models.dalle.DALLE"
    _partial_: bool = True
    dim: int = MISSING
    depth: int = MISSING
    heads: int = MISSING
    dim_head: int = MISSING
    ff_mult: float = MISSING
    attn_dropout: float = MISSING
    ff_dropout: float = MISSING
    attn_types: list = MISSING  # cycled over the layers
    kernel_size: int = MISSING  # of conv_like attention
    sparse_options: dict = MISSING  # {nsa|sinkhorn|routing: {knob: value}}
    shared_attn_ids: Optional[list] = MISSING  # layers with equal ids share their attention
    shared_ff_ids: Optional[list] = MISSING
    share_input_output_emb: bool = MISSING
    rotary_emb: bool = MISSING
    shift_tokens: bool = MISSING  # each attention also reads the previous token and the code above
    loss_img_weight: float = MISSING
    cond_drop_prob: float = MISSING  # > 0 trains for classifier-free guidance (task.cond_scale)
    reversible: bool = MISSING


# ---- data ----------------------------------------------------------------------------------


@dataclass
class ShapesDataConfig:
    """Generated captioned images: one coloured shape each (nothing downloaded)."""

    _target_: str = "experiments.data.shapes.Shapes"
    image_size: int = MISSING
    text_seq_len: int = MISSING


@dataclass
class ImageFolderDataConfig:
    """Images with same-stem .txt captions, or WebDataset-style .tar shards (experiments/data/image_text.py)."""

    _target_: str = "experiments.data.image_text.ImageTextFolder"
    path: str = MISSING
    image_size: int = MISSING
    text_seq_len: int = MISSING
    resize_ratio: float = MISSING  # random resized crops keep this much of the area, or more
    truncate_captions: bool = MISSING  # false: a caption longer than text_seq_len is an error
    val_fraction: float = MISSING
    channels: int = MISSING
    tokenizer: str = MISSING  # bytes, or a trained BPE: the path of a `tokenizers` JSON file


@dataclass
class TextDataConfig:
    """Byte-level text: the built-in corpus, or any file through `path`."""

    _target_: str = "experiments.data.text.ByteText"
    seq_len: int = MISSING
    path: Optional[str] = MISSING  # null: the built-in corpus (a fixed snapshot of Python 3.11.7's standard library)
    val_fraction: float = MISSING  # the validation split is taken from the end


@dataclass
class StdlibDataConfig:
    """The running interpreter's standard-library sources (they differ between Python versions)."""

    _target_: str = "experiments.data.text.InterpreterStdlib"
    seq_len: int = MISSING
    val_fraction: float = MISSING  # the validation split is taken from the end
    cache_dir: str = MISSING  # where the joined sources are kept after the first build


@dataclass
class Enwik8DataConfig:
    _target_: str = "experiments.data.text.Enwik8"
    seq_len: int = MISSING
    path: str = MISSING
    train_bytes: int = MISSING
    val_bytes: int = MISSING


@dataclass
class MQARDataConfig:
    """Multi-query associative recall, generated (experiments/data/recall.py)."""

    _target_: str = "experiments.data.recall.MQAR"
    vocab_size: int = MISSING  # keys from the lower half, values from the upper half
    seq_len: int = MISSING
    num_kv_pairs: int = MISSING
    power_a: float = MISSING  # query gaps drawn with weight gap^(power_a - 1)
    random_non_queries: bool = MISSING  # random tokens between the queries (else 0)
    max_pairs_offset: int = MISSING  # the pairs start at a random token in [0, this]: 0, Zoology's layout


@dataclass
class PasskeyDataConfig:
    """A passkey hidden in built-in filler text, asked for at the end (experiments/data/recall.py)."""

    _target_: str = "experiments.data.recall.Passkey"
    seq_len: int = MISSING
    digits: int = MISSING
    depth_bins: int = MISSING  # validation depths, reported per bin
    curriculum_seq_len: int = MISSING  # the first curriculum_steps steps train on items this long
    curriculum_steps: int = MISSING  # 0: every step at seq_len


# ---- optimizer and schedule (partials: parameters and optimizer are bound by the task) -----


@dataclass
class AdamConfig:
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = MISSING
    betas: list = MISSING
    eps: float = MISSING
    weight_decay: float = MISSING


@dataclass
class AdamWConfig(AdamConfig):
    _target_: str = "torch.optim.AdamW"
    weight_decay: float = MISSING


@dataclass
class CosineScheduleConfig:
    _target_: str = "experiments.runtime.schedule.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = MISSING
    total_steps: int = MISSING
    min_lr_ratio: float = MISSING


@dataclass
class PlateauScheduleConfig:
    """The DALL-E seed's lr_decay: halve the lr when the training loss stops falling."""

    _target_: str = "experiments.runtime.schedule.plateau"
    _partial_: bool = True
    window: int = MISSING  # steps per judged "epoch" (the mean loss of the window)
    factor: float = MISSING
    patience: int = MISSING
    cooldown: int = MISSING
    min_lr: float = MISSING


@dataclass
class ConstantScheduleConfig:
    _target_: str = "experiments.runtime.schedule.constant"
    _partial_: bool = True
    warmup_steps: int = MISSING


# ---- backend, tracker, task ----------------------------------------------------------------


@dataclass
class LocalBackendConfig:
    _target_: str = "experiments.runtime.backends.LocalBackend"


@dataclass
class DDPBackendConfig:
    _target_: str = "experiments.runtime.backends.DDPBackend"
    timeout_s: float = MISSING  # a collective waiting longer for a dead rank fails the job
    find_unused_parameters: bool = MISSING


@dataclass
class DeepSpeedBackendConfig:
    _target_: str = "experiments.runtime.backends.DeepSpeedBackend"
    zero_stage: int = MISSING  # 0-3
    offload_optimizer: str = MISSING  # none | cpu | nvme (ZeRO >= 1)
    offload_param: str = MISSING  # none | cpu | nvme (ZeRO 3)
    initial_loss_scale_power: int = MISSING  # fp16: dynamic loss scaling starts at 2^this
    config_file: Optional[str] = MISSING  # a DeepSpeed JSON to start from; the trainer's keys win
    timeout_s: float = MISSING


@dataclass
class NoTrackerConfig:
    """What names a run, whichever tracker records it (presets set these; `none` ignores them)."""

    _target_: str = "experiments.runtime.trackers.NoTracker"
    project: str = MISSING
    name: Optional[str] = MISSING  # null: the job's overrides, or the run directory's name
    group: Optional[str] = MISSING  # null: the sweep directory for sweep jobs
    tags: list = MISSING


@dataclass
class WandbConfig(NoTrackerConfig):
    _target_: str = "experiments.runtime.trackers.WandbTracker"
    entity: Optional[str] = MISSING
    mode: WandbMode = MISSING  # offline never needs the network; `wandb sync` later


@dataclass
class LanguageModelTaskConfig:
    _target_: str = "experiments.tasks.lm.LanguageModelTask"
    prime_length: int = MISSING  # bytes of validation text that prime each sample
    generate_length: int = MISSING
    num_samples: int = MISSING
    temperature: float = MISSING
    top_k: Optional[int] = MISSING  # null: the full distribution
    randomly_truncate_sequence: bool = MISSING  # each training row keeps a random length (routing seed)


@dataclass
class SpeculativeTaskConfig(LanguageModelTaskConfig):
    _target_: str = "experiments.tasks.speculative.SpeculativeTask"
    gamma: int = MISSING  # draft tokens per verification step
    distill_weight: float = MISSING  # the draft's loss adds this times KL(target || draft) on the same batches
    temperature: float = MISSING  # 0: greedy, which speculative decoding reproduces token for token
    engine: DecodingEngine = MISSING  # how both decoders run (models/decoding.py ENGINES)


@dataclass
class RecallTaskConfig:
    _target_: str = "experiments.tasks.recall.RecallTask"
    num_samples: int = MISSING  # validation items written to samples/ at each generation
    context_weight: float = MISSING  # weight of a next-token loss on every other token (0: answers alone)


@dataclass
class DiscreteVAETaskConfig:
    _target_: str = "experiments.tasks.dvae.DiscreteVAETask"
    num_samples: int = MISSING  # validation images shown over their reconstructions


@dataclass
class DalleTaskConfig:
    _target_: str = "experiments.tasks.dalle.TextToImageTask"
    vae_path: Optional[str] = MISSING  # a trained VAE: a dvae or dalle run (or checkpoint); null: train `vae` first
    vae_steps: int = MISSING  # the VAE stage before DALL-E's trainer.max_steps (none with vae_path)
    vae_lr: float = MISSING
    num_samples: int = MISSING  # validation captions drawn at each generation
    temperature: float = MISSING
    filter_thres: float = MISSING  # sample from the top (1 - filter_thres) of the image logits
    cond_scale: float = MISSING  # classifier-free guidance (needs model.cond_drop_prob > 0)


# every option of every group: conf/<group>/<name>.yaml starts from SCHEMAS[group][name]
SCHEMAS = {
    "model": {"transformer": TransformerConfig, "nsa": NSAConfig, "sinkhorn": SinkhornConfig,
              "routing": RoutingConfig, "moba": MoBAConfig, "dsa": DSAConfig, "dvae": DiscreteVAEConfig,
              "dalle": DalleConfig},
    "data": {"text": TextDataConfig, "stdlib": StdlibDataConfig, "enwik8": Enwik8DataConfig,
             "shapes": ShapesDataConfig, "image_folder": ImageFolderDataConfig, "mqar": MQARDataConfig,
             "passkey": PasskeyDataConfig},
    "optimizer": {"adam": AdamConfig, "adamw": AdamWConfig},
    "schedule": {"cosine": CosineScheduleConfig, "constant": ConstantScheduleConfig, "plateau": PlateauScheduleConfig},
    "backend": {"local": LocalBackendConfig, "ddp": DDPBackendConfig, "deepspeed": DeepSpeedBackendConfig},
    "tracker": {"wandb": WandbConfig, "none": NoTrackerConfig},
    "task": {"lm": LanguageModelTaskConfig, "speculative": SpeculativeTaskConfig, "recall": RecallTaskConfig,
             "dvae": DiscreteVAETaskConfig, "dalle": DalleTaskConfig},
}


@functools.cache
def register() -> None:
    """The schemas into Hydra's ConfigStore, as `<group>_<name>_schema` (top-level names, not groups:
    `--help` lists only the groups a user picks from), and the config's resolvers. Once a process: the
    store and the resolvers keep them, and storing ~40 schemas again costs ~60 ms at every compose."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(name=f"{group}_{name}_schema", node=node)
    OmegaConf.register_new_resolver("job_subdir", job_subdir, replace=True)
    OmegaConf.register_new_resolver("from_dense", from_dense, replace=True)
