"""What stock LLaMA-Factory 0.9.5 does with a run, restated so that ``qwenvl-prep`` can run without LF's internals:
the training YAML's frame, family and datasets (``run_spec``), the dataset records LF loads or drops
(``dataset_rules``), and the frame stock LF would feed the encoder (``drift``).

May import: ``plumbing``."""
