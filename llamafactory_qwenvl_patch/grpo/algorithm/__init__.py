"""What GRPO computes, as pure tensor functions: advantages (one registry of estimators), the policy loss (a
registry of surrogates and one of aggregations), per-token log-probs and entropies, the KL reference, the sampler
correction for vLLM and DAPO's dynamic-sampling rules.

May import: ``frame``, ``scoring`` and ``grpo.algorithm``.
"""
