"""The planning stage: what a kernel call does, decided once per key (NOTE: [The planning stage]).

``key.py`` says what a plan depends on, ``plan.py`` what it holds, ``stage.py`` keeps one kernel
function's records of keys (``shared.py``: shared by the kernel functions of one model built
with the same options), ``scope.py`` the implementations' view of one.
"""

from .key import PlanKey, input_shape_key, plan_key
from .plan import UNDECIDED, CallPlan, CallTemplate, Facts, Purpose
from .scope import Scope, cached
from .shared import shared_planner
from .stage import KeyRecord, Planner

__all__ = [
    "CallPlan", "CallTemplate", "Facts", "KeyRecord", "PlanKey", "Planner", "Purpose", "Scope", "UNDECIDED", "cached",
    "input_shape_key", "plan_key", "shared_planner",
]
