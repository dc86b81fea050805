"""Speculative decoding in the worker: proposing drafts (n-gram prompt lookup, a draft
model) and checking them against the model's own samples."""
