"""The training loop (loop.py), the hooks a task defines (task.py), and the tasks: lm, speculative,
dvae, dalle, recall (MQAR and passkey retrieval); positions.py is the language model's loss by
position, members.py rebuilds trained models from a checkpoint."""
