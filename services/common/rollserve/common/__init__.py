"""Pieces the rollserve services share (the scheduler and the engine)."""
