"""`pagedserve bench`: offline throughput, serving, accuracy and side-by-side benchmarks."""
