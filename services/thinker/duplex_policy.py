"""The duplex listen/speak decision policy (docs/model.md, Duplex), sampled for every duplex row of a step at
once.

A duplex unit decodes up to 19 tokens, and with several sessions every engine step holds several duplex
rows. Choosing them one row at a time, as a plain :class:`~services.thinker.sampling.Sampler` does, costs a
few host syncs per row (the raw first draw, the ``<|turn_eos|>`` sign test, the final draw) plus a
full-vocabulary sort for top-p; on the H200 that host work was as long as the forward itself. Here the whole
policy runs as batched device ops over the rows and the step syncs once, when the tokens come back.

Draws use the Gumbel-max trick (``argmax(logits + Gumbel noise)`` is an exact sample of
``softmax(logits)``), so every row's randomness is one uniform tensor: from the session's own generator
when it is seeded (the same seed gives the same tokens whatever else shares the batch), from the global
generator otherwise. Top-p runs over the top-k candidates, which is exact because top-k is applied first
(a renormalised top-k distribution is what top-p sees).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.common.checkpoint import SPECIAL_TOKEN_IDS
from services.common.device import to_device
from services.common.pb import thinker_pb2
from services.thinker.constrained import TOOL_CALL_END_ID, TOOL_CALL_ID, TokenConstraint
from services.thinker.duplex_policy_graph import graphs_for, warmup_policy_graphs
from services.thinker.sampling import Sampler, SamplingConfig, sample_from_logits

LISTEN = SPECIAL_TOKEN_IDS["<|listen|>"]
SPEAK = SPECIAL_TOKEN_IDS["<|speak|>"]
TTS_BOS = SPECIAL_TOKEN_IDS["<|tts_bos|>"]
TTS_PAD = SPECIAL_TOKEN_IDS["<|tts_pad|>"]
TURN_EOS = SPECIAL_TOKEN_IDS["<|turn_eos|>"]
CHUNK_EOS = SPECIAL_TOKEN_IDS["<|chunk_eos|>"]
CHUNK_TTS_EOS = SPECIAL_TOKEN_IDS["<|chunk_tts_eos|>"]
UNIT_TERMINATORS = frozenset({LISTEN, CHUNK_EOS, CHUNK_TTS_EOS})

MAX_TOKENS_PER_UNIT = 20  # the 20th is a forced <|chunk_eos|>, so at most 19 are sampled
TURN_EOS_LENGTH_PENALTY = 1.1
# A function call may run past the unit's 19 tokens: it is decoded whole within its unit, up to this many
# tokens from <tool_call> to </tool_call> (then <|turn_eos|> and <|listen|> end the turn and the unit).
MAX_TOOL_CALL_TOKENS = 512
CALL_UNIT_TOKENS = MAX_TOKENS_PER_UNIT - 1 + MAX_TOOL_CALL_TOKENS + 2  # the KV a unit that may call reserves


@dataclass
class DuplexSampling:
    """Duplex decode knobs (docs/model.md, Duplex defaults); the open message's sampling overrides them."""

    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    penalty_window: int = 512
    seed: int | None = None

    @classmethod
    def from_proto(cls, msg: thinker_pb2.SamplingParams) -> DuplexSampling:
        out = cls()
        if msg.HasField("temperature"):
            out.temperature = float(msg.temperature)
        if msg.HasField("top_k"):
            out.top_k = int(msg.top_k)
        if msg.HasField("top_p"):
            out.top_p = float(msg.top_p)
        if msg.HasField("repetition_penalty"):
            out.repetition_penalty = float(msg.repetition_penalty)
        if msg.HasField("seed"):
            out.seed = int(msg.seed)
        SamplingConfig(
            temperature=out.temperature,
            top_p=out.top_p,
            top_k=out.top_k,
            repetition_penalty=out.repetition_penalty,
        ).validate()
        return out


@dataclass
class PolicyState:
    """What the decision policy remembers across the units of a session."""

    turn_ended: bool = True
    history: list[int] = field(default_factory=list)  # every drawn id, as upstream (penalty window)
    generator: torch.Generator | None = None
    # Per-response budget (ThinkerUnit.max_output_tokens): spoken tokens the open model turn may still
    # draw; when it is spent the next token is <|turn_eos|>. None = unbounded.
    turn_budget: int | None = None
    budget_spent: bool = False  # the last turn was ended by the budget


@dataclass
class ToolCallPlan:
    """How a unit may call a function (ThinkerUnit.tool_call; docs/model.md, Duplex tool calls).

    ``matcher`` builds a fresh matcher of the call grammar (the chat route's: one ``<tool_call>`` block
    whose arguments follow the tool's schema). ``forced`` (``tool_choice`` required or named): a model turn
    that starts at this unit (a unit after the model's turn ended, or a unit that asks for a response) is
    that call, right after its ``<|speak|>`` decision. Otherwise (``auto``) the
    policy decides as always, and a ``<tool_call>`` the model draws is completed under the grammar.
    """

    matcher: Callable[[], TokenConstraint]
    forced: bool = False


class DuplexPolicy(Sampler):
    """One unit's token choice (docs/model.md, Duplex), run by the engine like any sampler.

    * forced listen: the unit answers ``<|listen|>`` without sampling;
    * a first draw from the raw distribution only detects ``<|chunk_eos|>`` (the model's own stop);
    * otherwise ``<|tts_pad|>``, the tokenizer's ``bad_token_ids`` and ``<|chunk_eos|>`` are masked, the
      repetition penalty (divide, over the last 512 drawn ids) and the ``<|turn_eos|>`` length
      penalty apply, and the token is drawn with temperature/top-k/top-p;
    * a ``<|listen|>`` while the model's turn has not ended becomes ``<|tts_bos|>``;
    * forced speak (benchmarks, ``request_response``) masks ``<|listen|>`` and skips the first draw
      for the unit's decision token;
    * with a :class:`ToolCallPlan`, a function call is decoded under its grammar (the tokens the grammar
      allows, drawn with the session's temperature/top-k/top-p; no duplex masks or penalties), past the
      unit's 19-token cap, and is followed by a forced ``<|turn_eos|>`` and ``<|listen|>``: the call ends
      the model's turn and the unit.
    """

    def __init__(
        self,
        sampling: DuplexSampling,
        state: PolicyState,
        forbidden: torch.Tensor,
        *,
        force_listen: bool,
        force_speak: bool,
        tool_call: ToolCallPlan | None = None,
    ) -> None:
        super().__init__(
            SamplingConfig(max_tokens=MAX_TOKENS_PER_UNIT - 1, stop_token_ids=tuple(UNIT_TERMINATORS))
        )
        self.sampling = sampling
        self.state = state
        self.forbidden = forbidden
        self.force_listen = force_listen
        self.force_speak = force_speak
        self.tool_call = tool_call
        # The call's progress in this unit: None (no call), "call" (grammar tokens), "turn_eos", "listen".
        self.call_phase: str | None = None
        self.call_start = 0  # index of the call's first token among the unit's tokens
        self._limit = MAX_TOKENS_PER_UNIT - 1
        self._skip_accept = False  # the forced call's decision token is not the grammar's

    @property
    def max_new_tokens(self) -> int:
        """The unit's token cap: 19, or the end of a call that started in this unit."""
        return self._limit

    @property
    def reserve_tokens(self) -> int:
        """A unit that may call reserves the KV of a whole call (the cap grows only once the call starts)."""
        return CALL_UNIT_TOKENS if self.tool_call is not None else self._limit

    def _gen(self, device: torch.device) -> torch.Generator | None:
        if self.sampling.seed is None:
            return None
        if self.state.generator is None or self.state.generator.device != device:
            self.state.generator = torch.Generator(device=device)
            self.state.generator.manual_seed(self.sampling.seed)
        return self.state.generator

    def choose(self, logits: torch.Tensor, history: Any, num_generated: int) -> int:
        return self.choose_rows([self], logits.unsqueeze(0), [history], [num_generated])[0]

    @classmethod
    def choose_rows(
        cls,
        samplers: Sequence[Sampler],
        logits: torch.Tensor,
        histories: Sequence[Sequence[int]],
        num_generated: Sequence[int],
    ) -> list[int]:
        """Tokens for ``logits [n, V]`` (one row per policy), computed on the device with one host sync."""
        policies: list[DuplexPolicy] = [p for p in samplers if isinstance(p, DuplexPolicy)]
        assert len(policies) == len(samplers), "choose_rows takes duplex policies only"
        out = [LISTEN] * len(policies)
        live: list[int] = []
        for i, p in enumerate(policies):
            if p.force_listen:
                continue
            if p.call_phase is None:
                live.append(i)
            else:
                out[i] = p._call_token(logits[i], num_generated[i])
        if not live:
            return out
        rows = [policies[i] for i in live]
        generated = [num_generated[i] for i in live]
        tokens = _graph_tokens(rows, logits[live], generated) if logits.is_cuda else None
        if tokens is None:
            tokens = _policy_tokens(rows, logits[live].float(), generated)
        for i, token in zip(live, tokens, strict=True):
            out[i] = policies[i]._after_draw(token, num_generated[i])
        return out

    def _after_draw(self, token: int, num_generated: int = 1) -> int:
        """Host-side rules that depend on the session's state; they run after the single sync."""
        if token == CHUNK_EOS:
            return token  # the model's own stop (first draw): the turn state is untouched
        plan = self.tool_call
        # A forced call is the turn that starts here: a new model turn, or the unit that asks for a response
        # (request_response), which starts one even where the model's previous turn was left open.
        starts = self.state.turn_ended or self.force_speak
        if plan is not None and plan.forced and num_generated == 0 and starts:
            if token not in UNIT_TERMINATORS:  # the model takes the floor: its turn is the forced call
                self._start_call(num_generated + 1, skip_decision=True)
                return self._note(SPEAK)
        if plan is not None and token == TOOL_CALL_ID:  # the model starts a call itself ("auto")
            self._start_call(num_generated, skip_decision=False)
            return self._note(token)
        # Matches upstream (StreamDecoder.decode): every id the draw returns enters the penalty history,
        # special ids included, and it enters before the listen -> <|tts_bos|> replacement below (which
        # upstream's streaming_generate applies after decode returned). Keeping only ids below the first
        # special id (151643), after the replacement, diverges from it (docs/fidelity.md, duplex).
        self.state.history.append(token)
        window = self.sampling.penalty_window
        if len(self.state.history) > 4 * window:
            del self.state.history[:-window]  # the penalty only looks at the window
        if token == LISTEN and not self.state.turn_ended:
            token = TTS_BOS
        if num_generated > 0:  # a unit's first token is its decision, never spoken
            token = self._spend_budget(token)
        if token not in UNIT_TERMINATORS:
            self.state.turn_ended = token == TURN_EOS
        return token

    def _note(self, token: int) -> int:
        """A token chosen outside the draw's rules (a call's): into the history and the turn state."""
        self.state.history.append(token)
        window = self.sampling.penalty_window
        if len(self.state.history) > 4 * window:
            del self.state.history[:-window]
        if token not in UNIT_TERMINATORS:
            self.state.turn_ended = token == TURN_EOS
        if token == TURN_EOS:
            self.state.turn_budget = None
        return token

    def _start_call(self, start: int, *, skip_decision: bool) -> None:
        """Decode a call from token ``start`` on under a fresh matcher of the plan's grammar."""
        assert self.tool_call is not None
        self.constraint = self.tool_call.matcher()
        self.call_phase = "call"
        self.call_start = start
        self._limit = start + MAX_TOOL_CALL_TOKENS + 2
        self._skip_accept = skip_decision

    def _call_token(self, logits: torch.Tensor, num_generated: int) -> int:
        """The token of a row inside a call: a grammar token (``logits`` already carry the grammar's mask,
        :func:`services.thinker.sampling.choose_tokens`), then the forced ends of the turn and the unit."""
        if self.call_phase == "turn_eos":
            self.call_phase = "listen"
            return self._note(TURN_EOS)
        if self.call_phase == "listen":
            self.call_phase = None
            return self._note(LISTEN)
        s = self.sampling
        row = logits.float()
        if s.temperature <= 0.0:
            token = int(torch.argmax(row).item())
        else:
            token = sample_from_logits(row, s.temperature, s.top_k, s.top_p, self._gen(row.device))
        return self._note(token)

    def accept(self, token: int) -> None:
        """A call's tokens advance its grammar; ``</tool_call>`` (or a grammar error) ends the call."""
        if self.constraint is None:
            return
        if self._skip_accept:
            self._skip_accept = False
            return
        self.constraint.accept(token)
        if self.constraint.failed or (token == TOOL_CALL_END_ID and self.constraint.matcher.is_accepting()):
            self.constraint = None
            self.call_phase = "turn_eos"  # a failed call ends there too (reported as cut: no </tool_call>)

    def _spend_budget(self, token: int) -> int:
        """A per-response budget counts the spoken tokens of the open turn; once it is spent the next token
        that would speak becomes ``<|turn_eos|>``, which ends the turn (and its span) there."""
        state = self.state
        if state.turn_budget is None or token in UNIT_TERMINATORS or token in (SPEAK, TTS_BOS, TURN_EOS):
            if token == TURN_EOS:
                state.turn_budget = None
            return token
        if state.turn_budget <= 0:
            state.turn_budget = None
            state.budget_spent = True
            return TURN_EOS
        state.turn_budget -= 1
        return token

    def finish_reason(self, token: int, num_generated: int) -> str | None:
        if token in UNIT_TERMINATORS:
            return "stop"
        if self.call_phase == "call" and num_generated - self.call_start >= MAX_TOOL_CALL_TOKENS:
            # The call ran out of tokens before its grammar completed: the unit and the turn end here.
            self.constraint, self.call_phase = None, None
            self.state.turn_ended = True
            return "length"
        if num_generated >= self.max_new_tokens:
            return "length"
        return None


def _uniform(policies: Sequence[DuplexPolicy], cols: int, device: torch.device) -> torch.Tensor:
    """``[n, cols]`` uniforms in (0, 1): a seeded session draws from its own generator, the rest together."""
    u = torch.rand(len(policies), cols, device=device)
    for r, p in enumerate(policies):
        gen = p._gen(device)
        if gen is not None:
            u[r] = torch.rand(cols, device=device, generator=gen)
    return u.clamp_(min=torch.finfo(torch.float32).tiny)


def _gumbel_argmax(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Exact categorical samples of ``softmax(scores)`` per row (``-inf`` entries are never drawn)."""
    return torch.argmax(scores - torch.log(-torch.log(u)), dim=-1)


def _penalty_window(
    policies: Sequence[DuplexPolicy], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every row's penalty window as ``ids [n, W]`` and the divisor ``[n, 1]``, copied without a stream sync.

    The window goes as it is, repeated ids included: the penalty gathers every listed logit, divides it
    and scatters it back, so an id listed twice is written twice with the same value, exactly as if it
    were listed once. That spares the per-row ``sorted(set(...))`` and a Python list of ``n * 512`` pairs,
    which cost ~4-6 ms a step at 16 rows on the host (now ~0.5 ms). Short rows are padded with their own first id; a row
    without history (or without a penalty) gets divisor 1.0, which leaves every logit bit for bit as it is.
    """
    windows: list[np.ndarray] = []
    divisors: list[float] = []
    for p in policies:
        s = p.sampling
        hist = p.state.history[-s.penalty_window :] if s.repetition_penalty != 1.0 else []
        windows.append(np.fromiter(hist, dtype=np.int64, count=len(hist)))
        divisors.append(float(s.repetition_penalty) if hist else 1.0)
    width = max(w.shape[0] for w in windows)
    if width == 0:
        return None
    ids = np.zeros((len(windows), width), dtype=np.int64)
    for r, w in enumerate(windows):
        if w.shape[0]:
            ids[r, : w.shape[0]] = w
            ids[r, w.shape[0] :] = w[0]
    return to_device(torch.from_numpy(ids), device), _per_row(divisors, device)


def _forbidden_rows(policies: Sequence[DuplexPolicy], device: torch.device) -> torch.Tensor:
    """The rows' forbidden-id masks on the device: ``[1, V]`` when the sessions share one (the usual case).

    Each session's mask is moved to the device once and kept there (a per-step host copy of 150k bools
    per row would cost a copy and a sync every step).
    """
    for p in policies:
        if p.forbidden.device != device:
            p.forbidden = p.forbidden.to(device)
    masks = {id(p.forbidden): p.forbidden for p in policies}
    if len(masks) == 1:
        return policies[0].forbidden.unsqueeze(0)
    return torch.stack([p.forbidden for p in policies])


def _per_row(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(list(values), dtype=torch.float32), device).unsqueeze(1)


def _policy_tokens(
    policies: Sequence[DuplexPolicy], logits: torch.Tensor, num_generated: Sequence[int]
) -> list[int]:
    """The duplex draw (docs/model.md, Duplex) for every row of fp32 ``logits [n, V]`` (none forced to
    listen); returns raw tokens."""
    device = logits.device
    n, vocab = logits.shape
    sampled = [p.sampling.temperature > 0.0 for p in policies]
    forced_now = [p.force_speak and g == 0 for p, g in zip(policies, num_generated, strict=True)]
    rows_sampled = to_device(torch.tensor(sampled, dtype=torch.bool), device)
    rows_forced = to_device(torch.tensor(forced_now, dtype=torch.bool), device)

    # 1. The raw first draw only detects the model's own <|chunk_eos|> (skipped for a forced speak).
    first = torch.argmax(logits, dim=-1)
    if any(sampled):
        first = torch.where(rows_sampled, _gumbel_argmax(logits, _uniform(policies, vocab, device)), first)
    model_stop = (first == CHUNK_EOS) & ~rows_forced

    # 2. Masks and penalties.
    masked = policy_logits(policies, logits, rows_forced if any(forced_now) else None)

    # 3. The decision: greedy argmax, or temperature -> top-k -> top-p -> draw.
    token = torch.argmax(masked, dim=-1)
    if any(sampled):
        token = torch.where(rows_sampled, _sample_top_k_top_p(policies, masked, sampled), token)
    token = torch.where(model_stop, torch.full_like(token, CHUNK_EOS), token)
    return [int(x) for x in token.tolist()]  # the step's one sync


def _graph_tokens(
    policies: Sequence[DuplexPolicy], logits: torch.Tensor, num_generated: Sequence[int]
) -> list[int] | None:
    """The draw as a captured replay (:mod:`services.thinker.duplex_policy_graph`), or None when these
    rows cannot take it: a seeded session, masks of their own, another top-k or window than captured."""
    graphs = graphs_for(policies[0].forbidden)
    if graphs is None or any(
        p.sampling.seed is not None or p.forbidden is not graphs.forbidden_1d for p in policies
    ):
        return None
    vocab = int(logits.shape[1])
    ks = [min(p.sampling.top_k, vocab) if p.sampling.top_k > 0 else vocab for p in policies]
    sampled = [p.sampling.temperature > 0.0 for p in policies]
    k = max((k for k, s in zip(ks, sampled, strict=True) if s), default=graphs.default_k)
    if not graphs.has(len(policies), k) or any(p.sampling.penalty_window > graphs.width for p in policies):
        return None
    params = np.empty((len(policies), 6), dtype=np.float32)
    windows: list[np.ndarray] = []
    for r, (p, g) in enumerate(zip(policies, num_generated, strict=True)):
        s = p.sampling
        hist = p.state.history[-s.penalty_window :] if s.repetition_penalty != 1.0 else []
        windows.append(np.fromiter(hist, dtype=np.int64, count=len(hist)))
        params[r] = (
            float(s.repetition_penalty) if hist else 1.0,
            max(s.temperature, 1e-5),
            ks[r],
            s.top_p,
            sampled[r],
            p.force_speak and g == 0,
        )
    return graphs.tokens(logits, params, windows, k)


def policy_logits(
    policies: Sequence[DuplexPolicy], logits: torch.Tensor, rows_forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Step 2 of the duplex draw on fp32 ``logits [n, V]``: the masks and both penalties (a new tensor).

    A function of its own so the fidelity dump can record the logits the decision's argmax reads.
    """
    device = logits.device
    masked = logits.masked_fill(_forbidden_rows(policies, device), float("-inf"))
    masked[:, CHUNK_EOS] = float("-inf")
    if rows_forced is not None:
        for col in (LISTEN, CHUNK_TTS_EOS):
            masked[:, col].masked_fill_(rows_forced, float("-inf"))
    window = _penalty_window(policies, device)
    if window is not None:
        ids, divisor = window
        # Matches upstream: the logit of every id in the window is divided by the penalty whatever its
        # sign, so a negative logit moves up (HF's processor would multiply those).
        masked.scatter_(1, ids, masked.gather(1, ids) / divisor)
    t = masked[:, TURN_EOS]
    # Matches upstream: the <|turn_eos|> length penalty 1.1 always applies (streaming_generate never
    # passes decode's length_penalty), dividing a positive logit and multiplying a negative one.
    masked[:, TURN_EOS] = torch.where(t > 0, t / TURN_EOS_LENGTH_PENALTY, t * TURN_EOS_LENGTH_PENALTY)
    return masked


def _sample_top_k_top_p(
    policies: Sequence[DuplexPolicy], masked: torch.Tensor, sampled: Sequence[bool]
) -> torch.Tensor:
    """Sampled tokens for every row (rows that are greedy get a throwaway draw)."""
    device = masked.device
    vocab = masked.shape[1]
    ks = [min(p.sampling.top_k, vocab) if p.sampling.top_k > 0 else vocab for p in policies]
    k = max(k for k, s in zip(ks, sampled, strict=True) if s)
    temps = _per_row([max(p.sampling.temperature, 1e-5) for p in policies], device)
    vals, ids = torch.topk(masked / temps, k, dim=-1)  # sorted, best first
    rank = torch.arange(k, device=device).unsqueeze(0)
    vals = vals.masked_fill(rank >= _per_row(ks, device), float("-inf"))
    top_p = _per_row([p.sampling.top_p for p in policies], device)
    probs = torch.softmax(vals, dim=-1)
    mass_before = probs.cumsum(-1) - probs  # probability of the better-ranked candidates
    # HF semantics: drop the low tail whose cumulative mass is <= 1 - top_p; the best token always stays.
    keep = (mass_before < top_p) | (rank == 0)
    vals = vals.masked_fill(~keep, float("-inf"))
    pick = _gumbel_argmax(vals, _uniform(policies, k, device))
    return ids.gather(1, pick.unsqueeze(1)).squeeze(1)


def load_forbidden_mask(ckpt_root: Any, vocab_size: int) -> torch.Tensor:
    """``<|tts_pad|>`` + ``bad_token_ids`` of ``tokenizer_config.json`` as a bool mask over the vocab."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[TTS_PAD] = True
    try:
        cfg = json.loads((ckpt_root / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return mask
    bad = [int(i) for i in cfg.get("bad_token_ids", []) if 0 <= int(i) < vocab_size]
    if bad:
        mask[torch.tensor(bad)] = True
    return mask


@functools.lru_cache(maxsize=8)
def forbidden_mask_for(ckpt_root: Any, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The checkpoint's forbidden mask on ``device``, loaded once and shared by every session."""
    return load_forbidden_mask(ckpt_root, vocab_size).to(device)


def warmup_duplex_policy(ckpt_root: Any, vocab_size: int, device: torch.device, max_rows: int) -> int:
    """Capture the policy's draw for up to ``max_rows`` duplex rows at the default sampling (CUDA only).

    Sessions with the default top-k and penalty window then take one replay a step; returns the number of
    graphs captured (0 off CUDA or with :data:`services.thinker.duplex_policy_graph.ENABLED` False).
    """
    if device.type != "cuda":
        return 0
    defaults = DuplexSampling()
    return warmup_policy_graphs(
        forbidden_mask_for(ckpt_root, vocab_size, device),
        max_rows,
        top_k=defaults.top_k,
        width=defaults.penalty_window,
        ids=(CHUNK_EOS, LISTEN, CHUNK_TTS_EOS, TURN_EOS),
        penalty=TURN_EOS_LENGTH_PENALTY,
    )
