"""Request: one sequence being generated, with its tokens, progress and finish state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from kvharbor.common.block_hash import BlockHash, extend_block_hashes
from kvharbor.engine.sampling_params import SamplingParams

# NOTE: sibling samples get internal ids "<group id>\x1f<index>". User ids must be printable, so
# none can contain the separator and a fork can never take a user's id.
SAMPLE_SEPARATOR = "\x1f"


def sample_id(group_id: str, index: int) -> str:
    """The request id of sample `index` of a user request (sample 0 keeps the user's id)."""
    return group_id if index == 0 else f"{group_id}{SAMPLE_SEPARATOR}{index}"


def check_request_id(request_id: object) -> str:
    """Raise ValueError unless `request_id` is a non-empty printable string."""
    if not isinstance(request_id, str) or not request_id or not request_id.isprintable():
        raise ValueError(f"request ids must be non-empty printable strings, got {request_id!r}")
    return request_id


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client went away or asked to cancel
    ERROR = "error"  # the engine failed while running it


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


class Request:
    """One sequence. For n > 1 the first sample forks siblings that share the prompt's blocks:
    `group_id` names the user's request and `index` the sample within it.

    Token accounting, as one line:
        | prompt_token_ids | output_token_ids |           == all_token_ids (num_tokens)
        | num_computed_tokens (KV written) | tokens still to run |
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_output_tokens: int,
        namespace: BlockHash,
        *,
        priority: int = 0,
        tenant: str | None = None,
        arrival_time: float | None = None,
        group_id: str | None = None,
        index: int = 0,
        lora: str | None = None,
    ) -> None:
        self.request_id = request_id
        # A pooling request's vector once its prompt ran, and its mean's running sum (engine/pooling.py).
        self.embedding = None
        self.pool_sum = None
        self.lora = lora  # the LoRA adapter it runs on (engine/lora/lora_manager.py); None: the base model
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_output_tokens = max_output_tokens
        self.namespace = namespace
        self.priority = priority
        self.tenant = tenant
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        self.logprobs: list[Logprob] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.forked = params.n == 1  # whether the n samples exist yet
        self.guide: Any = None  # structured output: its engine/structured/guides.Guide, else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int, logprob: Logprob | None = None) -> None:
        if self.guide is not None:
            self.guide.advance(token_id)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of all_token_ids (extended incrementally, kept on self)."""
        return extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.namespace)

    def fork(self, index: int, request_id: str) -> Request:
        """A sibling sample: same prompt and progress, no output yet (the caller shares blocks).

        Called after the prompt ran and before its first token is appended.
        """
        assert not self.output_token_ids, "fork before the first sampled token is appended"
        child = Request(
            request_id,
            self.prompt_token_ids,
            self.params,
            self.max_output_tokens,
            self.namespace,
            priority=self.priority,
            tenant=self.tenant,
            arrival_time=self.arrival_time,
            group_id=self.group_id,
            index=index,
            lora=self.lora,
        )
        child.block_hashes = list(self.block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.forked = True
        child.guide = self.guide.fork() if self.guide is not None else None  # its own path from here
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, prio={self.priority}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, out={len(self.output_token_ids)}, {self.status.value})"
        )
