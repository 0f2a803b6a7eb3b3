"""The ``"xla"`` backend: the dense function as a plain Flax MLP writes it (the baseline every
speed ratio is taken against); plain autodiff. It has no building blocks: ``ffn.py`` runs it."""

from twell_jax.backends.base import Backend

BACKEND = Backend(sparse=False)
