"""Triton-agnostic helpers of the generator model's response path (coalescing, bookkeeping)."""
