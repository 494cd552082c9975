"""One file per policy. Register new ones in ``rollserve.scheduler.core.policy``."""
