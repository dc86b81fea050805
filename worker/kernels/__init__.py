"""The CPU kernels: `cpu_extension` builds and loads the C++ extension from worker/csrc,
`cpu_ops` holds the Python entry points of its operations."""
