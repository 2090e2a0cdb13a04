"""``stage: grpo`` for ``llamafactory-cli train``: GRPO with verifiable rewards on LLaMA-Factory's own pipeline, read
by role: ``algorithm`` (what is computed), ``rollout`` (what a rollout holds and how its rows are laid out),
``rewards`` (how answers are scored), ``generation`` (where answers come from), ``trainer`` (how the trainer steps);
``args`` holds the YAML keys. The LF glue that builds a run lives in ``integration`` (``grpo_workflow``).

May import: ``frame``, ``image_io``, ``scoring``, ``agent`` and this sub-package, never ``integration``. Inside it,
each part imports only the parts before it in this order: ``algorithm``, ``rollout``, ``rewards``, ``generation``,
``trainer``; ``args`` may import any of them.
"""
