"""The kernels the models run on, chosen by one Backend at load (backend.py): paged attention (torch ops,
C decode attention, Triton on the GPU), the CPU linear layers with RMSNorm and rotary rows in C, the whole
CPU decode step in C, and the pure-torch oracle every kernel is tested against (reference.py)."""
