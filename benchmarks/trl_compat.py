"""Import trl 0.24's GRPOTrainer on the pinned stack (transformers 5.x), as the reference the benchmark and the
math tests compare against.

``from trl import GRPOTrainer`` fails here with ``No module named 'mergekit'``: trl 0.24's ``import_utils`` reads
``transformers.utils.import_utils._is_package_available(name)`` as a bool, but transformers 5.x returns a
``(bool, version)`` tuple, which is always truthy, so trl believes every optional package (mergekit, vllm, unsloth,
...) is installed and imports it. Unwrapping those tuples before importing the trainer is enough.
"""

from __future__ import annotations


def import_trl_grpo() -> tuple[type, type]:
    """(GRPOConfig, a GRPOTrainer subclass that drops the `mm_token_type_ids` trl 0.24 cannot forward)."""
    import trl.import_utils as iu

    for name, value in list(vars(iu).items()):
        if name.startswith("_") and name.endswith("_available") and isinstance(value, tuple):
            setattr(iu, name, value[0])
    iu._vllm_available = False  # trl 0.24 imports vLLM 0.10's GuidedDecodingParams, gone in 0.28; no vLLM used here
    from trl import GRPOConfig, GRPOTrainer

    class Trl024GRPOTrainer(GRPOTrainer):
        """transformers 5.6 processors add ``mm_token_type_ids``, which trl 0.24 forwards to a method that does not
        take it; the model recomputes it from ``input_ids`` (our trainer does not pass it either)."""

        def _get_per_token_logps_and_entropies(self, *args, mm_token_type_ids=None, **kwargs):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    return GRPOConfig, Trl024GRPOTrainer
