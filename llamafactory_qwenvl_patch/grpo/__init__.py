"""``stage: grpo`` for ``llamafactory-cli train``: GRPO with verifiable rewards on LLaMA-Factory's own pipeline."""
