"""The frame core: what the model sees and where labels live in it.

The resize policy (every model-input size and coordinate mapping: ``policy``), the model-family registry
(``families``), qwen-vl-utils' ``smart_resize`` source (``smart_resize_source``), the policy a model folder carries
(``policy_record``), dataset stamps (``stamp``) and the M-RoPE token types that place image tokens (``mrope``).

May import: the standard library, third-party packages and this sub-package only. Everything else builds on it.
"""
