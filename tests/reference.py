"""Moved to :mod:`nemo_automodel.testing.reference` (shipped with the package, so benchmarks import it too).

Kept importable, without a definition of its own, for branches written before the move; new code imports
``nemo_automodel.testing.reference``.
"""

from nemo_automodel.testing.reference import (  # noqa: F401
    blockdiag_allowed,
    doc_ids_from_lengths,
    fill_rows_reference,
    fit_to_row_reference,
    reference_attention,
    segments_reference,
)
