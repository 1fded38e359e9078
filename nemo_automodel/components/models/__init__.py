"""The causal LM and how its attention reaches block-diagonal CP."""
