"""What one `generate` call did: tau and acceptance by block position (every DFlash 2 loop fills one)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DFlash2Stats:
    """What one `generate` call did. `acceptance_length` (tau) = completion tokens / target forwards (prefill included).

    For a batch every count is per row (`rows` sequences): tau is then the mean tokens a row gains per verification.
    `loop` names the loop that ran the call: "dflash2" (DFlash 2's own loop), "transformers" (transformers'
    assisted loop; `loop_reason` says why) or "plain" (a batch above the speculative limit, decoded without drafts).
    In transformers' loop, `draft_step` says how the drafter's step ran: "graph" (a replayed CUDA graph) or "eager".
    """

    block_size: int
    rows: int = 1
    target_forwards: int = 0
    completion_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    loop: str = "transformers"
    loop_reason: str | None = None
    draft_step: str | None = None

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * (self.block_size - 1)

    @classmethod
    def of_plain_decoding(cls, block_size: int, rows: int, completion_tokens: int) -> "DFlash2Stats":
        """A call that decoded without the drafter: one target forward per token of each row (tau 1), no drafts."""
        return cls(block_size, rows=rows, target_forwards=completion_tokens, completion_tokens=completion_tokens,
                   loop="plain")

    @property
    def acceptance_length(self) -> float:
        return self.completion_tokens / max(self.target_forwards, 1)

    @property
    def drafting_rounds(self) -> int:
        return max(self.target_forwards - self.rows, 0)  # every row's prefill is a forward without drafts

    def acceptance_rate_per_position(self) -> list[float]:
        rounds = max(self.drafting_rounds, 1)
        return [count / rounds for count in self.accepted_per_position]

    def record_round(self, accepted: int) -> None:
        """One verification forward that accepted the first `accepted` drafts of its block."""
        self.target_forwards += 1
        for position in range(min(accepted, self.block_size - 1)):
            self.accepted_per_position[position] += 1

    def summary(self) -> str:
        rates = " ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position())
        return (
            f"tau {self.acceptance_length:.2f} ({self.completion_tokens} tokens / {self.target_forwards} target "
            f"forwards); acceptance by block position: {rates}"
        )


def truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Host-side twin of `cut_after_eos` for the token lists our own loops emit."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens
