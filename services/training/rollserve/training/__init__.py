"""Training of the small reasoning model that the workload, demo, tests and benchmarks use."""
