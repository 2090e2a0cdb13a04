"""File and process plumbing every command shares: atomic writes and locks (``atomic``), where a command may write
(``outputs``), image headers without decoding (``imageinfo``), and how worker processes print and die (``workers``).

May import: nothing else of ``qwenvl_prep``."""
