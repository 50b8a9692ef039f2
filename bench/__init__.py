"""Benchmarks: the simulator's policy study (bench/sim) and the live serving benchmarks."""
