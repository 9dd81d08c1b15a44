"""Executor: user-side client (proxy), transport, rank entry point, the per-rank loop, scheduler,
sampler and model runner. Only scheduler, request and messages are imported eagerly (no torch)."""
