"""Structured outputs and per-request token masks (llguidance).

`spec.StructuredOutputs` (what the output must match; validated when built), `compiler`
(compiles constraints off the engine loop, cached), `constraint` (per-request mask state and
the bitmask fill the sampler applies). ARCHITECTURE.md, "Structured outputs", has the design.
"""
