"""The planning stage: what a kernel call does, decided once per key (NOTE: [The planning stage]).

``key.py`` says what a plan depends on, ``plan.py`` what it holds, ``stage.py`` keeps one kernel
function's facts and plans.
"""

from .key import PlanKey, input_shape_key, plan_key
from .plan import UNDECIDED, CallPlan, CallTemplate, Facts, Purpose
from .stage import Planner

__all__ = [
    "CallPlan", "CallTemplate", "Facts", "PlanKey", "Planner", "Purpose", "UNDECIDED", "input_shape_key", "plan_key",
]
