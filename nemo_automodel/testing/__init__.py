"""The test kit shipped with the package (as ``torch.testing``): one definition each of what the tests and the
benchmarks share, so neither edits ``sys.path``. Not the training path: nothing in ``nemo_automodel.components`` or
``nemo_automodel.recipes`` imports it.

- :mod:`.syncs`: control collectives and host syncs counted in any code;
- :mod:`.dist`: local gloo groups (``init_gloo``, ``run_ranks``, ``free_port``);
- :mod:`.workloads`: document-length mixes (``sft_mix``) and a q/k/v/o ``AttentionBlock``;
- :mod:`.cases` and :mod:`.reference`: CP parity cases and their float64 references.
"""
