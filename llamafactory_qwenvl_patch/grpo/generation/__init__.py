"""Where answers come from: sampling settings (``settings``), HF generation that prefills each prompt once (``hf``),
the colocated vLLM engine (``vllm_engine``), its weight sync (``weight_sync``) and video prompts (``vllm_video``),
the ZeRO-3 gather budget of HF rollouts (``gather_budget``), and an agent's trajectories played turn by turn
against its environments (``agent_episodes``).

May import: ``frame``, ``image_io``, ``scoring``, ``agent``, ``grpo.algorithm``, ``grpo.rollout``, ``grpo.rewards``
and ``grpo.generation``.
"""
