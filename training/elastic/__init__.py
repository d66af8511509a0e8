"""Elastic training: three programs (the host agent, the JAX worker, the local slice) and what they share."""
