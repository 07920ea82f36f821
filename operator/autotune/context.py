"""What the operator's reconcile pass and the autotuner's hook (hook.py) hand each other:
the context of one pass for one LLMDeployment, and the autotuner's outcome."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..api.spec import LLMDeploymentSpec
from ..api.status import AutotuneStatus, Condition, Effective, LLMDeploymentStatus
from ..manifests.objects import Owner
from ..runtime.apply import Kube


@dataclass(frozen=True)
class AutotuneContext:
    """What the autotuner's hook is given on each pass (mode Recommend or Auto)."""
    owner: Owner
    spec: LLMDeploymentSpec
    status: LLMDeploymentStatus  # the previous status (effective, autotune report, conditions)
    effective: Effective  # the settings running now
    kube: Optional[Kube] = None  # for the scale subresource, HPA lookup and Events


@dataclass
class AutotuneOutcome:
    """The hook's answer: its report (an AutotuneStatus, or the camelCase dict of
    autotune.report.build_report(...).dump()), and the settings it wants (Auto
    mode applies them within the spec's bounds; Recommend only reports them)."""
    report: AutotuneStatus | dict
    proposed: Optional[Effective] = None
    # The autotuner's own conditions (e.g. PrefixCacheIneffective); None keeps the previous ones.
    conditions: Optional[list[Condition]] = None
    # Telling the world about an applied change (its Event, the decision counter): run only
    # once the status that records the change is written, so that an operator killed in
    # between leaves no Event for a change that status (the autotuner's memory) does not
    # hold, and the next leader's repeat of that decision is announced once, not twice.
    announce: Optional[Callable[[], None]] = None

    def status(self) -> AutotuneStatus:
        r = self.report
        return r if isinstance(r, AutotuneStatus) else AutotuneStatus.model_validate(r)
