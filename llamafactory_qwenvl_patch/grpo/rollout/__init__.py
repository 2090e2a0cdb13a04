"""What a rollout holds and how its rows are laid out for the training passes: the typed parts and micro-batches
(``types``), the tensor helpers (``tensors``), LF's collator for GRPO (``collate``), a record's meta (``meta``), and
the packed shared-prefix layout (``shared_prefix``, ``linear_prefix``).

May import: ``frame``, ``image_io``, ``scoring``, ``grpo.algorithm`` and ``grpo.rollout``.
"""
