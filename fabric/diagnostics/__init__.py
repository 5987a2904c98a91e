"""Collective diagnostics: which collective each rank last entered, and why a collective timed out or broke.

Used by the parallel strategies. Nothing here imports fabric.strategies (the strategies sit above it).
"""
