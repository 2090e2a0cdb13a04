"""LLaMA-Factory integration: the patches the import hook applies (``lf_patch`` names them; one module per LF part:
``parser_patch``, ``model_patch``, ``template_patch``, ``data_patch``, ``tuner_patch``, ``chat_patch``, with shared
helpers in ``patching``), the pinned multimodal plugin (``plugin``), serving and inference in the training frame
(``serving``), the plugin's YAML keys (``yaml_keys``), the guard on LF's private names (``lf_compat``), the training
pre-flight (``preflight``) and the check that every node shares one output folder (``shared_storage``).

May import: anything in the package. Imported only by the hook (``_hook``), the GRPO workflow and this sub-package:
everything below it works without LLaMA-Factory's internals.
"""
