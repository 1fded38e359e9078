"""Distributed-training components."""
