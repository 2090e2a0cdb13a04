"""Where answers come from: sampling settings (``settings``), HF generation that prefills each prompt once (``hf``),
the colocated vLLM engine (``vllm_engine``), its weight sync (``weight_sync``) and video prompts (``vllm_video``),
and the ZeRO-3 gather budget of HF rollouts (``gather_budget``).

May import: ``frame``, ``image_io``, ``scoring``, ``grpo.algorithm``, ``grpo.rollout``, ``grpo.rewards`` and
``grpo.generation``.
"""
