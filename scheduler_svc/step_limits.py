"""The scheduler's step limits (tokens and sequences in a step): its flags where given, else what
the executor recommends (vLLM's rule for its device), never more than an executor was sized for.
Plain Python; the engine asks at every attach."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from scheduler_svc.config import SchedulerConfig

log = logging.getLogger(__name__)

_FLAGS = {"max_num_batched_tokens": "--max-num-batched-tokens", "max_num_seqs": "--max-num-seqs"}
_UNITS = {"max_num_batched_tokens": "tokens", "max_num_seqs": "seqs"}


@dataclass(frozen=True)
class StepLimits:
    """Describe's step limits: what the executor recommends, whether it was sized for no more
    (`bounded`), how it chose them, and the sizes of its captured graphs."""

    max_num_batched_tokens: int
    max_num_seqs: int
    bounded: bool
    source: str
    decode_graph_sizes: tuple[int, ...] = ()
    small_step_graph_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepLimitsGiven:
    """Which of SchedulerConfig's step limits the operator set (a flag or its variable); the
    others come from the executor. Both by default: a config built in code stands as built."""

    max_num_batched_tokens: bool = True
    max_num_seqs: bool = True


class StepLimitPolicy:
    """Chooses the step limits at each attach. A given flag always stands; an unset one takes the
    recommendation of the first executor that makes one and keeps it for later executors (a
    replacement recommending otherwise is logged, not followed); with an executor that makes none
    (built before step limits), the built-in default. An executor that is `bounded` is never sent
    more than it recommends: its value caps the choice while it is attached. The caps apply from
    the plan after the attach; the waiting queue's bound is not one of them."""

    def __init__(self, config: SchedulerConfig, given: StepLimitsGiven) -> None:
        self.config = config  # the flags' values, the built-in defaults where none was given
        self.given = given
        self.taken: StepLimits | None = None  # the first recommendation, kept

    def for_executor(self, offered: StepLimits | None, address: str) -> SchedulerConfig:
        """The scheduler config to run `address`'s executor with; logs the choice. Raises
        ValueError for an executor whose recommendation no config can hold."""
        _check(offered, address)
        taken = self.taken if self.taken is not None else offered
        chosen, said = {}, []
        for name in _FLAGS:
            chosen[name], source = self._choose(name, taken, offered, address)
            said.append(f"{chosen[name]} {_UNITS[name]} ({source})")
        self.taken = taken
        log.info("step limits with executor %s: %s a step; %s", address, ", ".join(said),
                 _graphs(offered, chosen["max_num_seqs"]))
        return replace(self.config, **chosen)

    def _choose(self, name: str, taken: StepLimits | None, offered: StepLimits | None,
                address: str) -> tuple[int, str]:
        """(value, where it came from) of one limit."""
        flag, given = _FLAGS[name], getattr(self.given, name)
        recommended = getattr(offered, name) if offered is not None else None
        if given:
            value = getattr(self.config, name)
            source = flag
            if recommended is not None:
                source = f"{flag}; the executor recommends {recommended}"
        elif offered is None:  # an executor built before step limits: sized by its own flag
            value = getattr(self.config, name)
            source = "built-in default: the executor recommends none"
        else:
            value = getattr(taken, name)
            source = f"from the executor: {taken.source}"
            if recommended != value:
                source = (f"kept from the first executor: {taken.source}; this one recommends "
                          f"{recommended}")
        if offered is None or not offered.bounded or value <= recommended:
            return value, source
        wanted = (f"{flag} {value}" if given
                  else f"{value} {_UNITS[name]} kept from the first executor")
        log.warning("%s is more than executor %s was sized for (%d): its steps stay within %d; "
                    "raise the executor's %s to allow more", wanted, address, recommended,
                    recommended, flag)
        return recommended, f"{wanted}, capped to what the executor was sized for"


def _check(offered: StepLimits | None, address: str) -> None:
    if offered is None:
        return
    for name in _FLAGS:
        if getattr(offered, name) < 1:
            raise ValueError(f"executor {address} recommends {name} {getattr(offered, name)}: "
                             "it must be >= 1")


def _graphs(offered: StepLimits | None, max_num_seqs: int) -> str:
    """What the executor's graphs cover, for the attach line."""
    if offered is None or not (offered.decode_graph_sizes or offered.small_step_graph_sizes):
        return "no CUDA graphs"
    parts = []
    if offered.decode_graph_sizes:
        sizes = offered.decode_graph_sizes
        # a decode step of max_num_seqs seqs replays the smallest graph that holds it
        largest = next((size for size in sizes if size >= max_num_seqs), sizes[-1])
        unused = sum(size > largest for size in sizes)
        parts.append(f"decode graphs for {sizes[0]}-{sizes[-1]} seqs ({len(sizes)} sizes"
                     + (f", {unused} beyond the seq cap unused)" if unused else ")"))
    if offered.small_step_graph_sizes:
        sizes = offered.small_step_graph_sizes
        parts.append(f"small-step graphs for {sizes[0]}-{sizes[-1]} tokens")
    return ", ".join(parts)
