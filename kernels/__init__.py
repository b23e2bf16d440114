"""Compute kernels: Numba reductions for host data and CUDA/HIP sources for device data."""
