"""The work behind the commands, callable from Python: convert (``convert``, one record in ``convert_record``, the
registry in ``dataset_info``), ``curriculum``, ``check``, ``draw``, ``predict``, ``evaluate`` and ``fix_config``.
Nothing here parses arguments or prints for a user; ``commands/`` does.

May import: ``plumbing``, ``lf``, ``formats``."""
