"""Typed recipe configuration: the structured-config schema and its environment checks."""
