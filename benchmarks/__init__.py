"""Benchmarks and measurements of the engine, run from the repository root as `python -m benchmarks.NAME`; not part
of the installed package. step_costs and synthetic are the helpers the others import."""
