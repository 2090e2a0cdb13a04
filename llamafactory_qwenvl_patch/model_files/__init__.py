"""A saved model folder's files as each reader needs them: the config layout (``config_layout``), the one layout
that transformers 4.49 to 5.x and vLLM 0.11 all read in the training frame (``portable``), and what a given reader
cannot load or would load differently (``readers``). Pure reads and rewrites of JSON files; no model is loaded.

May import: ``frame`` and this sub-package.
"""
