"""Compare engine greedy output with HF generate, allowing divergence only at HF's own near-ties."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-5


@dataclass
class Divergence:
    prompt_index: int
    step: int
    top2_gap: float


def hf_greedy(
    hf_model, prompt_ids: list[int], max_new: int, ignore_eos: bool = False
) -> tuple[list[int], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """HF generate's greedy tokens and logits; ignore_eos: past EOS too, as GenerationParams.ignore_eos."""
    out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **({"eos_token_id": []} if ignore_eos else {}),
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), [lg[0] for lg in out.logits]


def check_greedy(
    index: int, ours: list[int], theirs: list[int], logits: list[torch.Tensor]
) -> Divergence | None:
    """Identical, or the first difference sits where HF's top-2 logits are within NEAR_TIE."""
    for step, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            top2 = logits[step].float().topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, (
                f"prompt {index}: token {step} differs ({a} vs {b}), HF top-2 gap {gap:.2e}"
            )
            return Divergence(index, step, gap)
    assert ours == theirs, f"prompt {index}: lengths differ: {len(ours)} vs {len(theirs)}"
    return None
