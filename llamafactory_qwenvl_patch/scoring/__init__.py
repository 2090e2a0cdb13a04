"""Scoring answers: the one answer parser (``answers``), grounding and field metrics (``metrics``), field
extraction scores (``fields``) and reward-hack detectors (``cheats``). Pure functions, shared by rewards,
``qwenvl-prep eval`` and GRPO evaluation.

May import: ``frame`` and this sub-package.
"""
