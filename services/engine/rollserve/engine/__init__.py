"""The rollserve engine: one vLLM AsyncLLM behind the rollserve.v1.Engine gRPC service."""
