"""Stand-in for TransformerEngine main (d0067d0da, 2.20.0.dev0): only ``pytorch.DotProductAttention``."""

__version__ = "2.20.0.dev0"
