"""The training loop (loop.py), the hooks a task defines (task.py), and the tasks: lm, speculative,
dvae, dalle; members.py rebuilds trained models from a checkpoint."""
