"""What a rollout holds and how its rows are laid out for the training passes: the typed parts and micro-batches
(``types``), the tensor helpers (``tensors``), LF's collator for GRPO (``collate``), a record's meta (``meta``), and
the packed shared-prefix layout (``shared_prefix``, ``linear_prefix``); for agents, each turn rendered with LF's
template (``turns``), the forward over turns with explicit positions (``turn_forward``) and trajectories as rows,
one per trajectory or packed behind the task's root (``agent_rows``).

May import: ``frame``, ``image_io``, ``scoring``, ``grpo.algorithm`` and ``grpo.rollout``.
"""
