"""Simulation of vLLM engines for fleet-scale scheduling benchmarks on one machine.

Everything here is labelled simulated in its output: a cost model of an engine step
(``profile``), an engine that batches, caches prefixes and preempts like vLLM by that model
(``engine_model``), and a discrete-event loop that runs the scheduler's own policies in
virtual time (``des``).
"""
