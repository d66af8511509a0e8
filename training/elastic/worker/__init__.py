"""The JAX worker: one training process per host, warmed up as a standby and run one round at a time."""
