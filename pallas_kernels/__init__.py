"""Pallas kernels for GPU, each beside its pure-JAX twin.

Convention (DESIGN.md §10): ``pallas_kernels/x.py`` defines ``x(...)`` (the Pallas
kernel) and ``x_ref(...)`` (pure JAX, same signature: the code the model ran before
the kernel); a test compares them (interpret mode on a CPU, the GPU lowering on a
GPU), and one switch (selection.py) picks kernel or reference per op for the
platform in use. Kernels: sparse_attention (one layer's paged sparse attention with
sinks), index_select (CSA indexer scores + top-k), grouped_matmul (MoE grouped
matmuls, SwiGLU fused). probe.py compiles the chosen kernels at start on a GPU and
drops to the reference for one that does not lower.
"""
