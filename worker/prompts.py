"""Jobs into rows: each job's prompt rendered by its model's template and tokenised, within the model's input
limit (cut only where the job allows), with its own new-token limit and adapter."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from shared.errors import INPUT_TOO_LONG, INTERNAL, JobFailure
from shared.job import Job
from worker.config import ModelsConfig, ModelSpec
from worker.loading import LoadedBase
from worker.rows import Item
from worker.templates import Pieces, prompt_pieces_many


class Encoder:
    """Encodes jobs for the resident bases (one tokenizer per base)."""

    def __init__(self, config: ModelsConfig, bases: dict[str, LoadedBase]) -> None:
        self.config = config
        self.bases = bases

    def encode(self, job: Job, *, index: int = 0) -> Item:
        """One job's row; raises the JobFailure it fails with."""
        (item,) = self.encode_many([job], first_index=index)
        if isinstance(item, JobFailure):
            raise item
        return item

    def encode_many(self, jobs: Sequence[Job], *, first_index: int = 0) -> list[Item | JobFailure]:
        """Each job's prompt as token ids (index-aligned), or the JobFailure that job fails with. The jobs of
        one base are tokenised together (see `prompt_pieces_many`)."""
        by_base: dict[str, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            by_base[self.config.models[job.model].base].append(i)
        out: list[Item | JobFailure | None] = [None] * len(jobs)
        for base_name, indices in by_base.items():
            base = self.bases[base_name]
            requests = [(self.config.models[jobs[i].model], jobs[i]) for i in indices]
            for i, pieces in zip(indices, prompt_pieces_many(base.tokenizer, requests), strict=True):
                if isinstance(pieces, JobFailure):
                    out[i] = pieces
                    continue
                try:
                    out[i] = self._item(first_index + i, jobs[i], pieces)
                except JobFailure as failure:
                    out[i] = failure
        # Index-aligned, always: a job nothing was made for fails in its own place rather than shifting the rest.
        return [o if o is not None else JobFailure(INTERNAL, "the job's prompt was not encoded") for o in out]

    def _item(self, index: int, job: Job, pieces: Pieces) -> Item:
        """A job's encoded row: its prompt within the model's input limit (cut only where the job allows)."""
        spec = self.config.models[job.model]
        base = self.bases[spec.base]
        total = sum(len(ids) for ids, _ in pieces)
        if total > spec.max_input_tokens:
            if not job.truncate:
                raise JobFailure(
                    INPUT_TOO_LONG,
                    f"prompt is {total} tokens; {job.model}'s limit is {spec.max_input_tokens} "
                    '(set "truncate": true to cut the user text instead)',
                )
            pieces = truncate(pieces, total - spec.max_input_tokens, spec)
        ids = [t for seg_ids, _ in pieces for t in seg_ids]
        max_new = min(job.max_new_tokens or spec.max_new_tokens, spec.max_new_tokens)
        return Item(index=index, job=job, ids=ids, max_new=max_new, adapter=base.adapters[job.model])


def truncate(pieces: Pieces, excess: int, spec: ModelSpec) -> Pieces:
    """Cut `excess` tokens from the end of the longest user segment (the template framing stays whole)."""
    user = [i for i, (ids, is_user) in enumerate(pieces) if is_user]
    if not user:
        raise JobFailure(INPUT_TOO_LONG, f"the template alone exceeds {spec.name}'s {spec.max_input_tokens} tokens")
    longest = max(user, key=lambda i: len(pieces[i][0]))
    ids = pieces[longest][0]
    if len(ids) <= excess:
        raise JobFailure(INPUT_TOO_LONG, f"cannot truncate to {spec.max_input_tokens} tokens for {spec.name}")
    out = list(pieces)
    out[longest] = (ids[: len(ids) - excess], True)
    return out
