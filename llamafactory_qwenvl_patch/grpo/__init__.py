"""``stage: grpo`` for ``llamafactory-cli train``: GRPO with verifiable rewards on LLaMA-Factory's own pipeline.

May import: ``frame``, ``image_io``, ``scoring`` and this sub-package; only its LF glue (``workflow``, which builds
the run from LF's loaders, and ``record_meta``, which carries each record's ``meta`` through LF's dataset code)
imports ``integration``.
"""
