"""transformers' own assisted generation with a Gemma 4 assistant, round by round.

`hf_assisted(target, assistant, prompt_ids, k, n)` runs `Gemma4ForCausalLM.generate` with
`assistant_model` (transformers' SinglePositionMultiTokenCandidateGenerator), greedy, and
returns the new tokens and, per round, the drafts and how many of them the target accepted.

`fixed=True` hands the candidate generator the keys and values of every verified position
instead: transformers' own target forward over the sequence but its newest token (no cache),
whose `shared_kv_states` end at the newest verified token, the one whose final hidden state
the assistant reads. transformers 5.25 slices the verify step's states to the new length of
the sequence, which after a rejection still holds the rejected draft's keys at the bonus
token's position (full layers) and, once a sliding layer's cache has dropped its oldest
positions, every draft of the round and not the oldest key of the assistant's window
(sliding layers); that is what the stock run measures. The first round and a round after a
full acceptance read the same keys either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AssistedRun:
    tokens: list[int]  # the generated tokens
    drafts: list[list[int]]  # per round: the K tokens drafted
    accepted: list[int]  # per round: how many of them the target accepted

    @property
    def tokens_per_round(self) -> float:
        """Accepted drafts + the bonus token, per round (mean_accepted_len)."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted)


def hf_assisted(target, assistant, prompt_ids: list[int], k: int, n: int, fixed: bool = False) -> AssistedRun:
    """Greedy assisted generation of `n` tokens after `prompt_ids` with K = `k` drafts per round."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    assistant.generation_config.num_assistant_tokens = k
    original = SinglePositionMultiTokenCandidateGenerator.get_candidates
    lengths: list[int] = []
    drafts: list[list[int]] = []

    def get_candidates(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw):
        if fixed and model_outputs is not None and not is_first_iteration:
            with torch.no_grad():
                verified = target(input_ids=input_ids[:, :-1], return_shared_kv_states=True, use_cache=False)
            model_outputs = type(model_outputs)(**{**model_outputs, "shared_kv_states": verified.shared_kv_states})
        ids, logits = original(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw)
        if logits is not None:
            lengths.append(input_ids.shape[1])
            drafts.append(ids[0, input_ids.shape[1] :].tolist())
        return ids, logits

    SinglePositionMultiTokenCandidateGenerator.get_candidates = get_candidates
    try:
        with torch.no_grad():
            out = target.generate(
                torch.tensor([prompt_ids]),
                assistant_model=assistant,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,  # ignore_eos, as the engine runs with it
            )
    finally:
        SinglePositionMultiTokenCandidateGenerator.get_candidates = original
    total = out.shape[1]
    ends = [*lengths[1:], total]
    accepted = [end - start - 1 for start, end in zip(lengths, ends)]  # the round's bonus is the 1
    return AssistedRun(out[0, len(prompt_ids) :].tolist(), drafts, accepted)
