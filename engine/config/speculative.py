"""Speculative decoding settings, in the shape of vLLM's `--speculative-config` JSON.

Two methods: "ngram" (prompt-lookup decoding: drafts are copied from an earlier
occurrence of the sequence's last n tokens, no second model) and "draft_model" (a small
model proposes the drafts). vLLM's two spellings are accepted as they are, so one
deployment's flags work against either engine:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    {"model": "DIR", "num_speculative_tokens": 3}          # a model without a method

Every refusal names its field as `speculative_config.<field>`, since the whole config
arrives as one flag and the user needs to know which part of it is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

MAX_SPECULATIVE_TOKENS = 16  # K above this wastes target compute on drafts rarely accepted
METHODS = ("ngram", "draft_model")
_WHERE = "speculative_config."


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int  # K, 1..MAX_SPECULATIVE_TOKENS
    prompt_lookup_max: int = 4  # ngram only: the longest suffix n-gram matched
    prompt_lookup_min: int = 1  # ngram only: the shortest
    model: str | None = None  # draft_model only: the draft's model (dir, builtin:..., hf://...)

    def __post_init__(self) -> None:
        # Checked here, not only in parse, so a config built in code is checked too.
        if self.method not in METHODS:
            raise ValueError(f"{_WHERE}method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{_WHERE}num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_WHERE}{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{_WHERE}prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"{_WHERE}model is for method draft_model; method ngram takes no "
                             f"model, got {self.model!r}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"{_WHERE}model must name the draft model (a directory, builtin:..., "
                             f"hf://...) for method draft_model, got {self.model!r}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config from the flag's JSON text or an already decoded dict; None/"" -> None
        (speculative decoding off). A model without a method means draft_model, as in vLLM."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object, got invalid JSON "
                                 f"({e.msg} at char {e.pos})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise ValueError(f"{_WHERE}{unknown[0]}: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        values = dict(value)
        method = values.get("method")
        if method is None:
            if values.get("model") is None:
                raise ValueError(f"{_WHERE}method must be given (one of {', '.join(METHODS)}), "
                                 "or a model for a draft model")
            values["method"] = method = "draft_model"
        if method == "draft_model":
            # Defaults for direct construction; a user who sets them for a draft model has
            # misread the method, so say so instead of ignoring them.
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if name in values:
                    raise ValueError(f"{_WHERE}{name} is for method ngram, not draft_model")
        if "num_speculative_tokens" not in values:
            raise ValueError(f"{_WHERE}num_speculative_tokens must be given (1.."
                             f"{MAX_SPECULATIVE_TOKENS})")
        return cls(**values)
