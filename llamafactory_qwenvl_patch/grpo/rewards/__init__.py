"""How completions are scored: the reward API, loader and harness (``registry``), the built-ins (``builtin``,
``video``, ``length``, and ``agent`` for trajectories), the rollout's logged statistics and hack monitors (``monitors``) and the greedy evaluation
metrics (``evaluation``).

May import: ``frame``, ``image_io``, ``scoring``, ``agent`` (its loader of user code), ``grpo.algorithm``,
``grpo.rollout`` and ``grpo.rewards``.
"""
