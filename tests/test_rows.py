"""``rows.row_views``: overlapping row views of one tensor whose gradients land in one buffer."""

from __future__ import annotations

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp.rows import row_views
from nemo_automodel.testing.glue import WrittenBytes

SPANS = [
    ((0, 4), (2, 5), (8, 0), (3, 2)),  # overlaps, an empty view, rows 7..9 read by none
    ((0, 10), (1, 2)),  # a view inside another
    ((5, 5), (0, 5)),  # out of order, covering every row
    ((1, 3), (1, 3), (6, 2)),  # the same span twice
]


def _loss(views: tuple[torch.Tensor, ...], unused: int | None) -> torch.Tensor:
    return sum((v * (i + 1)).sin().sum() for i, v in enumerate(views) if i != unused)


@pytest.mark.parametrize("spans", SPANS)
@pytest.mark.parametrize("unused", [None, 0])
def test_row_views_gradient_is_exact(spans, unused):
    x = torch.randn(1, 3, 10, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _loss(row_views(t, spans), unused), (x,))
    views = row_views(x, spans)
    for (start, n), view in zip(spans, views):
        assert view._base is x and torch.equal(view, x[:, :, start : start + n])  # views, not copies


def test_row_views_writes_each_row_once_token_major():
    """Backward: one token-major buffer; covered rows copied (overlaps added), only uncovered rows zeroed."""
    base = torch.randn(1, 10, 3, 4, requires_grad=True)
    x = base.mul(1.0).transpose(1, 2)  # token-major, not a leaf: its gradient is consumed as it is
    views = row_views(x, ((0, 4), (2, 5)))  # rows 0..6 covered (2..3 twice), 7..9 not
    loss = _loss(views, None)
    grads = []
    x.register_hook(grads.append)
    with WrittenBytes() as counter:
        loss.backward()
    row = 3 * 4 * 4  # heads * dim * float32
    written: dict[str, int] = {}
    for key, size in counter.bytes.items():
        if key.startswith(("copy_", "add_", "zero_")):
            written[key.split("(")[0]] = written.get(key.split("(")[0], 0) + size
    assert written == {"copy_": 7 * row, "add_": 2 * row, "zero_": 3 * row}
    assert grads[0].transpose(1, 2).is_contiguous()
    assert torch.equal(grads[0][:, :, 7:], torch.zeros(1, 3, 3, 4))


def test_one_span_of_every_row_is_the_tensor_itself():
    x = torch.randn(1, 2, 6, 3)
    assert row_views(x, ((0, 6),))[0] is x
