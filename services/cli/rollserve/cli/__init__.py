"""The ``rollserve`` command: dev stack, demo, models, benchmarks, and the services."""
