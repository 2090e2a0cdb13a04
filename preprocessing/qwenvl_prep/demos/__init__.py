"""The CPU demos (``grounding``, ``gui``, ``fields``), the steps they share (``steps``: each runs a real
``qwenvl-prep`` or ``llamafactory-cli`` command in a subprocess, as a user would) and the tiny random-weight models
they and the tests train (``tiny_model``), and the simulated GUI environment (``gui_env``) that GUI agents train on. A
new demo goes here, with its ``--task`` in ``commands/demo.py``.

May import: ``plumbing``, ``lf``, ``formats``."""
