"""Model definitions the built-in tasks train, and the attention a user's own model can share with them.

``training.models.attention(q, k, v, segment_ids=..., impl="auto")`` is the built-in Llama's attention:
causal, grouped-query, packed documents kept apart; Pallas's splash kernel on a TPU (see
:mod:`training.models.attention`).  Importing this package imports JAX.
"""

from training.models.attention import IMPLS, attention

__all__ = ["IMPLS", "attention"]
