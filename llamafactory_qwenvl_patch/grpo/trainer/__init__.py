"""How the trainer steps: ``GRPOTrainer`` (``trainer``) put together from one mixin per phase (``rollout_phase``,
``refill``, ``step``, ``metrics``, ``checkpoint``, and ``agent_phase`` with ``agent_play`` for a multi-turn
agent's rollout), its run
state declared in one place (``state``), each rank's prompt order (``prompt_order``) and what a checkpoint holds so
that a resumed run is the same run (``resume``).

May import: ``frame``, ``image_io``, ``scoring``, ``agent`` and all of ``grpo``.
"""
