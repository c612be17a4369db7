"""The contract of one engine step: what the scheduler plans (:class:`StepPlan`) and what the
runner reports back (:class:`StepOutput`). The runner needs nothing but the plan; the
scheduler learns nothing but what the output says."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Literal, Optional

if TYPE_CHECKING:
    from .embed.request import EmbedRequest
    from .kv.disk_tier import BlockData
    from .request import Request
    from .sampled import SampledRow

DraftKind = Literal["ngram", "forced"]
"""Which drafts a verify step checks: n-gram lookups of plain rows, or the tokens a
constrained row's grammar forces (rows nothing forces may carry looked-up drafts)."""


@dataclass
class KVStep:
    """What the runner does to KV memory for one step: the block tables of every row it runs
    (``tables[id(request)][group]``), the block copies to make first (a cached prefix's partly
    shared last block), and how many blocks the arrays must hold now (``blocks``) and may
    come to hold (``blocks_ahead``, to grow ahead); with a disk tier, the blocks to copy out
    for it before anything is written (``saves``: block, its name there) and those to write
    from it (``loads``: block, its data) before anything reads them; for a model with
    recurrent layers, each row's state slot (``state_slots[id(request)]``, :mod:`.kv.states`)
    and the kept states to put in new rows' slots first (``state_loads``: a checkpoint's name)."""

    tables: dict[int, list[list[int]]] = field(default_factory=dict)
    copies: list[tuple[int, int]] = field(default_factory=list)
    blocks: int = 0
    blocks_ahead: int = 0
    saves: list[tuple[int, bytes]] = field(default_factory=list)
    loads: list[tuple[int, "BlockData"]] = field(default_factory=list)
    state_slots: dict[int, int] = field(default_factory=dict)
    state_loads: dict[int, Hashable] = field(default_factory=dict)


@dataclass
class Verify:
    """A verify step: each decoding row runs its last token and up to ``k`` of its drafts
    (``Request.draft``) in one pass, and keeps the drafts its own sampler agrees with."""

    kind: DraftKind
    k: int


@dataclass
class StepPlan:
    """What one engine step does, decided by :meth:`.Scheduler.schedule`."""

    decode: list["Request"] = field(default_factory=list)
    """Running rows, each decoding a token (or verifying its drafts: :attr:`verify`)."""
    prefill: list["Request"] = field(default_factory=list)
    """Prompts prefilled whole (what follows their cached prefix) as one batch."""
    chunk: Optional[tuple["Request", int]] = None
    """A long prompt's next chunk: (request, tokens)."""
    embed: list[tuple["EmbedRequest", list[int]]] = field(default_factory=list)
    """Embedding calls and the indices of their inputs this step embeds."""
    verify: Optional[Verify] = None
    """The decode rows verify drafts (None: one token each)."""
    pipelined: bool = False
    """Decode rows take the tokens the runner computed ahead for them last step (the rest
    decode now); False: what was computed ahead is dropped (its PRNG keys put back)."""
    ahead: list["Request"] = field(default_factory=list)
    """Decode rows whose next step the runner computes ahead, on this step's still-lazy
    tokens (vLLM's async scheduling): KV room for it is held already."""
    kv: KVStep = field(default_factory=KVStep)

    @property
    def admitted(self) -> list["Request"]:
        """The requests whose prompts this step prefills (or goes on chunk-prefilling)."""
        return [*self.prefill, *([self.chunk[0]] if self.chunk else [])]

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.chunk or self.embed)


@dataclass
class Drafted:
    """What a verify step did with one row's drafts."""

    drafted: int
    accepted: int
    emitted: int  # tokens it emits: those kept, and the one sampled after (or an error)


@dataclass
class StepOutput:
    """What :meth:`.ModelRunner.run` did with a plan."""

    sampled: list[tuple["Request", list["SampledRow"]]] = field(default_factory=list)
    """Each row's new tokens (several where it kept drafts), in the order sampled: rows whose
    prefill ended (their first token), then decoding rows."""
    prefilled: list["Request"] = field(default_factory=list)
    """Rows whose prefill ended this step (every token they hold is computed)."""
    chunked: Optional[tuple["Request", int]] = None
    """The chunk run: (request, tokens), its prompt not yet all in."""
    embedded: list["EmbedRequest"] = field(default_factory=list)
    """Embedding calls whose every input now has its vector."""
    failed: list[tuple[object, BaseException, str]] = field(default_factory=list)
    """(request, error, while doing what): requests that failed alone."""
    drafts: dict[int, Drafted] = field(default_factory=dict)
    """``id(request)`` -> what its drafts came to, for the rows a verify step ran."""
    ahead: list["Request"] = field(default_factory=list)
    """Rows whose next step is computed ahead (may be fewer than planned: a draw failed)."""
    decoded: list["Request"] = field(default_factory=list)
    """The rows the decode (or verify) part of the step ran, in the order it ran them (their
    tokens are the last entries of :attr:`sampled`)."""
    decode_seconds: float = 0.0
    """How long the decode (or verify) part of the step took."""
    ragged: bool = False
    """Whether the last pass of several positions a row computed its real positions only."""
    physical_blocks: int = 0
    """Blocks the KV arrays hold after this step."""
    saved: list[tuple[bytes, "BlockData"]] = field(default_factory=list)
    """The plan's ``kv.saves`` copied out: (name, data), for the disk tier."""
    prompt_logprobs: list[tuple["Request", int, list["SampledRow"]]] = field(default_factory=list)
    """(request, first, scores): the prompt logprobs of its tokens ``first``, ``first + 1``, ...
    that this step's passes computed (for requests asking for them)."""
