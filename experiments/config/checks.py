"""Rules across config values that a type cannot express, checked before anything is built.

Rules that belong to one model live in its constructor (NSA: heads % kv_heads, stride <= block,
...), which raises a ValueError naming the knob before training starts; these are the trainer's.
"""

from experiments.runtime.errors import UserError


def check_trainer(trainer) -> None:
    problems = []
    for key in ("max_steps", "batch_size", "grad_accum", "val_batches", "log_every", "keep_checkpoints"):
        if trainer[key] < 1:
            problems.append(f"trainer.{key}={trainer[key]} must be at least 1")
    for key in ("validate_every", "generate_every", "checkpoint_every"):
        if trainer[key] < 0:
            problems.append(f"trainer.{key}={trainer[key]} must be 0 (off) or a number of steps")
    if trainer.clip_grad_norm is not None and trainer.clip_grad_norm <= 0:
        problems.append(f"trainer.clip_grad_norm={trainer.clip_grad_norm} must be positive, or null for no clipping")
    if trainer.threads is not None and trainer.threads < 1:
        problems.append(f"trainer.threads={trainer.threads} must be at least 1, or null for torch's default")
    if problems:
        raise UserError("; ".join(problems))
