"""The config's typed schemas (schema.py) and the rules across its values (checks.py).

`register()` puts the schemas in Hydra's ConfigStore and adds the resolvers the config uses; call
it before composing (train.py does). Nothing here imports torch, so `--help` stays fast.
"""

from experiments.config.schema import register

__all__ = ["register"]
