"""Distributed checkpoints (atomic, resumable) and the final HF export."""
