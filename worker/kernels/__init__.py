"""Attention kernels: a pure-torch reference (CPU path and test oracle) and Triton kernels for the GPU."""
