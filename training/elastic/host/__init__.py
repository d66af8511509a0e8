"""The host agent: one per host, its worker supervisor, and the leader that one agent of a job becomes."""
