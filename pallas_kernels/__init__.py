"""Pallas kernels for GPU, each beside its pure-JAX twin.

Convention (DESIGN.md §10): ``pallas_kernels/x.py`` defines ``x(...)`` (the Pallas
kernel) and ``x_ref(...)`` (pure JAX, same signature); a test compares them in
interpret mode on CPU, and a backend switch picks the kernel on GPU and the
reference elsewhere. No kernel has landed yet: the model runs on the pure-JAX
paths in deepinfer/models/deepseek_v4/.
"""
