"""Continuous batching: a :class:`~attnkit.models.GPT` serving many requests at once on
one :class:`~attnkit.PagedKVCache`.

Requests arrive (:meth:`Server.submit`) and leave (when they have their tokens) between
steps. Every :meth:`Server.step` is ONE forward over a packed row of tokens: one new
token for each request that is decoding, and the next chunk of the prompt of each
request still being prefilled, so long prompts are prefilled beside the running decodes
instead of stalling them::

    step 7 packed row:  [a:tok] [b:tok] [c:prompt 64..127] [d:prompt 0..40]
                         decode  decode  prefill chunk      prefill (ends: first token)

The linear layers run once on the whole row; attention runs sequence by sequence over
each one's pages (:meth:`attnkit.paged_kv_cache.PagedLayer.attend`), so no request sees
another's keys, and each gets exactly the tokens it gets alone (greedy decoding).

A request is admitted when the pool has pages for its prompt and all its new tokens, so
a running request never waits for memory (no preemption); the others wait their turn in
arrival order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnkit._validate import check_int, check_optional_int

if TYPE_CHECKING:
    from attnkit.models.gpt import GPT
    from attnkit.paged_kv_cache import PagedKVCache

__all__ = ["Server"]


@dataclass
class _Request:
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far
    seq: int | None = None  # its sequence in the pool, once admitted
    written: int = 0  # time indices whose keys are in the cache
    finished: bool = False


class Server:
    """Serve concurrent greedy generation requests with one model.

    Args:
        model: the GPT (set to eval; its linear weights are prepacked, as
            :meth:`GPT.generate` does).
        page_size: tokens per page of the cache.
        num_pages: pages in the pool (default: enough for ``max_batch`` requests of
            ``context_length`` tokens each).
        max_batch: most requests running at once.
        prefill_chunk: most prompt tokens of one request in one step.
        max_step_tokens: most tokens in one step's packed row (decodes come first).
        eos_id: a request that emits it stops there.

    Example:
        >>> from attnkit.models import GPT, GPTConfig
        >>> server = Server(GPT(GPTConfig.preset("tiny")), page_size=8)
        >>> rid = server.submit([1, 2, 3], max_new_tokens=4)
        >>> _ = server.run()
        >>> len(server.result(rid))
        7
    """

    def __init__(
        self,
        model: GPT,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        max_batch: int = 8,
        prefill_chunk: int = 128,
        max_step_tokens: int = 512,
        eos_id: int | None = None,
    ) -> None:
        from attnkit.models.gpt import GPT

        if not isinstance(model, GPT):
            raise TypeError(f"model must be an attnkit.models.GPT, got {type(model).__name__}")
        self.model = model
        ctx = model.cfg.context_length
        page_size = check_int(page_size, "page_size")
        self.max_batch = check_int(max_batch, "max_batch")
        self.prefill_chunk = check_int(prefill_chunk, "prefill_chunk")
        self.max_step_tokens = check_int(max_step_tokens, "max_step_tokens", minimum=self.max_batch)
        self.eos_id = check_optional_int(
            eos_id, "eos_id", minimum=0, maximum=model.cfg.vocab_size - 1
        )
        if num_pages is None:
            num_pages = self.max_batch * -(-ctx // page_size)
        model.eval()
        model.pack_weights()
        self.cache: PagedKVCache = model.setup_paged_cache(
            check_int(num_pages, "num_pages"), page_size
        )
        self._requests: dict[int, _Request] = {}
        self._waiting: deque[int] = deque()
        self._running: list[int] = []
        self._next_id = 0

    # -- the API ----------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int) -> int:
        """Queue a request; returns its id. It joins the running batch at a later
        :meth:`step`, when a slot and the pages for all its tokens are free.

        Args:
            prompt_ids: the prompt's token ids (a list, or a 1-D integer tensor).
            max_new_tokens: tokens to generate (fewer if ``eos_id`` comes first).

        Raises:
            TypeError / ValueError: ids that are not integers in the vocabulary, an empty
                prompt, or a prompt plus new tokens longer than ``context_length`` or than
                the whole pool.
        """
        prompt = _check_prompt(prompt_ids, self.model.cfg.vocab_size)
        n = check_int(max_new_tokens, "max_new_tokens")
        ctx = self.model.cfg.context_length
        if len(prompt) + n > ctx:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({n}) exceeds context_length ({ctx})"
            )
        if self.cache.pages_needed(len(prompt) + n) > self.cache.num_pages:
            raise ValueError(
                f"a request of {len(prompt) + n} tokens needs more pages than the pool holds "
                f"({self.cache.num_pages} of {self.cache.page_size} tokens)"
            )
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = _Request(prompt, n)
        self._waiting.append(rid)
        return rid

    def done(self, rid: int) -> bool:
        """Whether request ``rid`` has all its tokens."""
        return self._request(rid).finished

    def result(self, rid: int) -> list[int]:
        """The prompt and generated tokens of finished request ``rid``.

        Raises:
            ValueError: an unknown id, or a request not finished yet.
        """
        r = self._request(rid)
        if not r.finished:
            raise ValueError(f"request {rid} is not finished: step() until done({rid})")
        return r.prompt + r.tokens

    @property
    def running(self) -> tuple[int, ...]:
        """The ids of the requests admitted and not finished."""
        return tuple(self._running)

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + len(self._running)

    def step(self) -> dict[int, int]:
        """Admit what fits, then run one packed forward; returns the token each request
        got this step (``{request id: token}``; a request mid-prefill gets none)."""
        self._admit()
        if not self._running:
            return {}
        seqs, starts, counts, ids, emits = [], [], [], [], []
        budget = self.max_step_tokens
        decoding = [rid for rid in self._running if self._prefilled(rid)]
        prefilling = [rid for rid in self._running if not self._prefilled(rid)]
        for rid in decoding + prefilling:
            r = self._requests[rid]
            if rid in decoding:
                chunk = [r.tokens[-1]]
            else:
                chunk = r.prompt[r.written : r.written + min(self.prefill_chunk, budget)]
            if not chunk:
                continue
            assert r.seq is not None
            seqs.append(r.seq)
            starts.append(r.written)
            counts.append(len(chunk))
            ids.extend(chunk)
            emits.append(rid)
            budget -= len(chunk)
            r.written += len(chunk)
            if budget <= 0:
                break
        batch = self.cache.batch(seqs, starts, counts)
        idx = torch.tensor(ids, dtype=torch.long, device=self.cache.k_pages.device)[None]  # (1, N)
        with torch.inference_mode():
            logits = self.model.step(idx, batch.positions(idx.device), paged=batch)  # (1, n, v)
        next_ids = logits[0].argmax(-1).tolist()
        out: dict[int, int] = {}
        for rid, token in zip(emits, next_ids, strict=True):
            r = self._requests[rid]
            if not self._prefilled(rid):
                continue  # mid-prompt: the logits of a prompt token are not a new token
            r.tokens.append(token)
            out[rid] = token
            if len(r.tokens) == r.max_new_tokens or token == self.eos_id:
                self._finish(rid)
        return out

    def __iter__(self) -> Iterator[dict[int, int]]:
        """:meth:`step` until no request is waiting or running."""
        while self.pending:
            yield self.step()

    def run(self) -> dict[int, list[int]]:
        """Step until every request is finished; returns ``{id: prompt + tokens}`` of
        the requests that finished during the run."""
        before = {rid for rid, r in self._requests.items() if r.finished}
        for _ in self:
            pass
        return {
            rid: self.result(rid)
            for rid, r in self._requests.items()
            if r.finished and rid not in before
        }

    # -- scheduling -------------------------------------------------------------------------
    def _request(self, rid: int) -> _Request:
        if isinstance(rid, bool) or not isinstance(rid, int) or rid not in self._requests:
            raise ValueError(f"no request with id {rid!r}")
        return self._requests[rid]

    def _prefilled(self, rid: int) -> bool:
        r = self._requests[rid]
        return r.written >= len(r.prompt)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            r = self._requests[self._waiting[0]]
            total = len(r.prompt) + r.max_new_tokens
            if self.cache.pages_needed(total) > self.cache.num_free_pages:
                return  # first come, first served: the next one waits too
            r.seq = self.cache.allocate(total)
            self._running.append(self._waiting.popleft())

    def _finish(self, rid: int) -> None:
        r = self._requests[rid]
        r.finished = True
        assert r.seq is not None
        self.cache.free(r.seq)
        r.seq = None
        self._running.remove(rid)


def _check_prompt(prompt_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> list[int]:
    """The prompt as a list of ids, checked."""
    if isinstance(prompt_ids, torch.Tensor):
        if (
            prompt_ids.is_floating_point()
            or prompt_ids.is_complex()
            or prompt_ids.dtype == torch.bool
        ):
            raise TypeError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
        ids = [int(x) for x in prompt_ids.tolist()]
    else:
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise TypeError(
                f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}"
            )
        for x in prompt_ids:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"prompt_ids must hold ints, got {x!r}")
        ids = list(prompt_ids)
    if not ids:
        raise ValueError("prompt_ids is empty: a request needs at least one token")
    bad = [x for x in ids if not 0 <= x < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids must be in [0, {vocab_size}), got {bad[0]}")
    return ids
