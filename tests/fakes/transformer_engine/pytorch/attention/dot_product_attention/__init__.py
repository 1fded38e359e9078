"""``transformer_engine.pytorch.attention.dot_product_attention`` exists from TE 2.3."""

from transformer_engine.pytorch import flash_view

if flash_view.TE < (2, 3):
    raise ModuleNotFoundError(
        "No module named 'transformer_engine.pytorch.attention.dot_product_attention'",
        name="transformer_engine.pytorch.attention.dot_product_attention",
    )
