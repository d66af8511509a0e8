"""The local slice: simulated hosts on this machine, each a host agent and its worker, forked from one template."""
