"""GUI agents' environments: the public environment API (``types``: ``Observation``, ``Step``, ``Action``, the
``Environment`` protocol), user classes loaded by name (``loading``), every screenshot in the pinned frame and every
action back in the screen's pixels (``frame``), what an environment returns checked at the boundary (``checks``),
and the environments run, timed and isolated (``runner``, with ``worker`` on the environment's side).

``from llamafactory_qwenvl_patch.agent import Observation, Step, Action`` is the stable import for user environments.

May import: ``frame``, ``image_io``, ``scoring`` and this sub-package. ``grpo`` and ``integration`` may import it.
"""

from llamafactory_qwenvl_patch.agent.types import Action, Environment, Observation, Step

__all__ = ["Action", "Environment", "Observation", "Step"]
