"""How the trainer steps: ``GRPOTrainer`` (``trainer``) put together from one mixin per phase (``rollout_phase``,
``refill``, ``step``, ``metrics``, ``checkpoint``), its run state declared in one place (``state``), each rank's
prompt order (``prompt_order``) and what a checkpoint holds so that a resumed run is the same run (``resume``).

May import: ``frame``, ``image_io``, ``scoring`` and all of ``grpo``.
"""
