"""Google Kubernetes Engine, without a cluster: the JobSet manifests of a job and a local pod emulator."""
