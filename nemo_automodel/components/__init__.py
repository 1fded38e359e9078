"""Model-agnostic building blocks."""
