"""A run's workdir: lock and lease, storage (local or gs://), checkpoints, metrics, preemption."""
