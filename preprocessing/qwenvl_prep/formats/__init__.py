"""Dataset formats, one module each: what is read in (LF JSON / JSONL and flat rows in ``records`` with its streaming
``json_array`` parser, ``coco``, ScreenSpot and RefCOCO in ``benchmarks``, video spans and box tracks in
``temporal``, Charades-STA, ActivityNet Captions and QVHighlights as distributed in ``temporal_datasets``, a video
answer's times in ``video_labels``) and what is read back (a converted, stamped LF dataset in ``converted``,
prediction files joined to it in ``predictions``). A new dataset format goes here, with its name in
``records.detect_format`` and ``commands/convert.py``'s ``--format`` choices.

May import: ``plumbing``, ``lf``."""
