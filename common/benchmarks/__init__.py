"""Benchmark pieces that need no torch: workloads, the HTTP serving client, reports, charts."""
