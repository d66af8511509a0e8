"""Training as a service: runs share a pool of hosts, a priority moves hosts between them, an ETA per run.

``queue`` keeps the records on the storage root, ``policy`` decides who gets how
many hosts, ``scheduler`` applies it, ``eta`` forecasts each run's end, and
``commands`` holds the verbs (``rtrain submit | queue | priority | cancel``).
"""
