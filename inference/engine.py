"""The serving engine: one target, its tokenizer, an optional speculative config; one request at a time.

    engine = Engine.from_pretrained("reference", '{"method": "ngram", "num_speculative_tokens": 4}')
    result = engine.generate(engine.tokenizer("def f(").input_ids, GenerationConfig(max_new_tokens=32))
    result.text, result.tokens, result.finish_reason, result.stats

``SpeculativeConfig`` takes the keys of vLLM's ``--speculative-config`` JSON that this runtime
implements (``method``, ``model``, ``num_speculative_tokens``, ``prompt_lookup_min``,
``prompt_lookup_max``, as in ``vllm/config/speculative.py``); any other key is refused.

Startup:
  0. ``from_pretrained`` only: the memory plan (``inference/memory.py``) estimates weights + KV caches of the
     target and the drafter for ``max_model_len`` from their configs, before loading anything, and stops
     with advice (``MemoryPlanError``) when they exceed the device's free memory;
  1. parse the speculative config (unknown keys, bad values -> ValueError);
  2. eagle3: ``export.check.load_eagle3`` checks the head's metadata against the target and tokenizer
     (a mismatch raises ``HeadMismatchError``: the engine does not start); the head is loaded ONCE and
     the target is wrapped with the head's aux layers; k above the head's trained depth (``ttt_steps`` of
     draftsmith.json) is served with one warning (``proposers.eagle3.warn_beyond_trained_depth``);
     mlp_speculator: ``export.mlp_speculator.load_mlp_speculator`` checks it the same way; k must not exceed
     its n_predict stages (as vLLM refuses);
     draft_model: the draft is loaded once (``models.load_causal_lm``) and must share the target's
     tokenizer (``check_same_tokenizer``) and vocabulary size; a draftsmith export (a directory with
     draftsmith.json) must also record this target (``export.draft_model.check_draft_model``,
     ``HeadMismatchError`` naming the field; ``allow_mismatch`` applies);
     max_model_len (default: the target's declared position limit) must fit a draft's learned position table
     (GPT-2 ``n_positions``, OPT ``max_position_embeddings``; ValueError naming both and ``--max-model-len``);
     a RoPE draft or EAGLE-3 head declaring fewer positions is served with a warning;
  3. per request: a fresh proposer around the loaded head / draft (proposers hold per-sequence state).

Requests are served one at a time: the runtime's unit is one sequence (batch size 1), so ``generate``
holds a lock for the whole sequence and concurrent callers queue behind it (the server adds a
single-worker thread as its FIFO queue). Stop strings are found on the decoded text that is final
(``TextStream``: no character still split across tokens), token by token whatever the chunking, so plain
and speculative decoding stop at the same token: the output is cut before the first stop string,
generation ends at the token that completed it (finish_reason 'stop'), and streamed text is final text
minus any tail that could still become a stop string.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .generate import GenerationConfig, GenerationResult, SpecStats, generate_plain, generate_speculative
from .metrics import EngineMetrics
from .proposers import DraftModelProposer, NgramProposer, Proposal, Proposer, check_same_tokenizer
from .target import POSITION_LIMIT_KEYS, TargetModel, has_learned_positions, position_limit

logger = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("draft_model", "eagle3", "mlp_speculator", "ngram")
HEAD_METADATA_FILE = "draftsmith.json"     # what marks an exported head directory (EAGLE-3, MLP speculator)
DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15     # request seed + offset seeds the drafter's sampling generator


@dataclass
class SpeculativeConfig:
    """vLLM ``--speculative-config`` keys implemented here (same names, same meaning).

    Attributes:
        method: 'ngram' | 'draft_model' | 'eagle3' | 'mlp_speculator'. When omitted with a ``model``: the
            ``head_type`` of ``draftsmith.json`` when the model is an exported head directory, else
            'draft_model' (vLLM also infers the method from the model).
        model: EAGLE-3 / MLP speculator: the exported head directory; draft_model: the draft's name or path
            (``reference-draft`` is the embedded one); ngram: must be omitted.
        num_speculative_tokens: k, drafted tokens per verify step (>= 1; required).
        prompt_lookup_min, prompt_lookup_max: ngram only; shortest / longest suffix n-gram looked up
            (defaults 1 and max(5, prompt_lookup_min); ``inference/proposers/ngram.py``).

    Raises:
        ValueError: a missing or invalid value, or a key that does not apply to the method.
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self):
        if self.method is None:
            if self.model is None:
                raise ValueError(f"speculative config: 'method' is required (one of {', '.join(SPECULATIVE_METHODS)})")
            self.method = _head_type(Path(self.model)) or "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative config: method {self.method!r} is not supported; draftsmith implements "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative config: {name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative config: 'num_speculative_tokens' is required (drafted tokens per step, "
                             "e.g. 3 for EAGLE-3, 4 for ngram)")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative config: model must be a string, got {self.model!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(f"speculative config: method 'ngram' takes no model (got {self.model!r}); "
                                 f"use method 'draft_model' or 'eagle3' to draft with a model")
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = 1
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(5, self.prompt_lookup_min)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) > "
                                 f"prompt_lookup_max ({self.prompt_lookup_max})")
        else:
            if self.model is None:
                what = ("the draft model's name or path" if self.method == "draft_model"
                        else "the exported head directory")
                raise ValueError(f"speculative config: method {self.method!r} needs 'model' ({what})")
            given = [n for n in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"speculative config: {', '.join(given)} only apply to method 'ngram', "
                                 f"not {self.method!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeculativeConfig":
        """Build from a parsed JSON object; unknown keys are refused (naming the known ones)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; draftsmith "
                             f"accepts {', '.join(known)} (the vLLM --speculative-config keys it implements)")
        return cls(**data)

    @classmethod
    def parse(cls, value: "str | Mapping[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A config from a JSON string (as ``--speculative-config``), a dict, a config or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        return cls.from_dict(value)


def _head_type(path: Path) -> str | None:
    """``head_type`` recorded in an exported head directory's draftsmith.json (None: not a head directory)."""
    meta = path / HEAD_METADATA_FILE
    if not meta.is_file():
        return None
    try:
        return str(json.loads(meta.read_text(encoding="utf-8")).get("head_type") or "eagle3")
    except (OSError, ValueError, AttributeError):
        return "eagle3"           # unreadable: the eagle3 loader reports what is wrong with it


class RequestError(ValueError):
    """A request the engine cannot serve as asked (the server answers 4xx).

    Attributes:
        code: a short machine-readable reason ('context_length_exceeded', 'invalid_prompt', ...).
        param: the request field at fault, when there is one.
    """

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class RequestCancelled(Exception):
    """Raised by ``Engine.generate`` when its ``cancel`` event was set (e.g. the client went away)."""


@dataclass
class EngineResult(GenerationResult):
    """A ``GenerationResult`` (tokens cut at a stop string) plus what a server reports.

    Attributes:
        text: the decoded completion (special tokens skipped), cut before the first stop string.
        prompt_tokens: prompt length. ttft_s: arrival to first token (None when no token was made).
        latency_s: arrival to the end of generation.
    """

    text: str = ""
    prompt_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0


class _StopStringFound(Exception):
    """Raised from the token callback to end generation at a stop string."""


class _CountingProposer(Proposer):
    """Forwards to a proposer and counts the verification outcomes like ``SpecStats``, so that counts
    survive a generation ended early (stop string, cancel) by an exception from the token callback."""

    def __init__(self, inner: Proposer, k: int):
        self.inner, self.stats, self.verify_steps = inner, SpecStats(k=k), 0
        self.needs_aux_hidden = inner.needs_aux_hidden
        self.needs_final_hidden = inner.needs_final_hidden
        self._proposed = 0

    def start(self, prompt_ids, first_token, target_step) -> None:
        self.inner.start(prompt_ids, first_token, target_step)

    def propose(self, k: int) -> Proposal:
        proposal = self.inner.propose(k)
        self._proposed = int(proposal.tokens.numel())
        return proposal

    def accept(self, n_accepted, emitted, target_step) -> None:
        self.stats.record(self._proposed, int(n_accepted))
        self.verify_steps += 1
        self.inner.accept(n_accepted, emitted, target_step)


class TextStream:
    """Decoded text of a growing token list, with stop strings and streamed deltas.

    Tokens are read one at a time however they arrive (plain decoding: one per step; speculative: an accepted
    chunk of 1..k+1), so the outcome depends on the tokens only, never on the chunking. After each token the
    decoded text is split in:

        final text   what later tokens cannot change: everything before a trailing incomplete character
        open tail    the trailing '\\ufffd' a byte-level decode ends in while a character's bytes are split
                     across tokens ('é' = 2 bytes, '→' and '。' 3, '😀' 4); it turns final when the character
                     completes (or at ``finish``)

    ``text`` is the final text and only grows (until cut at a stop string): the tokens are decoded whole (a window
    of the last tokens would drop the space before a word that follows a skipped special token), special tokens
    skipped, without ``clean_up_tokenization_spaces`` (it rewrites text already final, "a ." -> "a."; transformers
    5 ignores it for BPE, vLLM's detokenizer never applies it), and what extends the final text is appended. A
    decode that does not extend it (a tokenizer whose decode is not prefix-stable) adds nothing until one does.

    Stop point (canonical): the fewest tokens n whose decoded text, trailing '\\ufffd' stripped, contains a stop
    string. ``add`` then cuts ``tokens`` after token n and ``text`` before the earliest stop string found, sends
    the rest and raises ``_StopStringFound``. Deltas sent to ``on_text`` are final text only, holding back any
    tail that may start a stop string, so nothing sent is ever changed or lies past a stop; ``finish()`` sends
    what is left (the open tail becomes final, and is searched for stop strings too).

    Attributes:
        tokens: the tokens read (cut after the stop point). text: the final text (cut before a stop string).
        stopped: True once a stop string was found.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.stop = tuple(s for s in stop if s)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self.sent = 0

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _find_stop(self, text: str, start: int) -> int | None:
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def add(self, chunk: Sequence[int]) -> None:
        """Read ``chunk`` token by token; raises ``_StopStringFound`` at the token that completes a stop string."""
        for token in chunk:
            self.tokens.append(int(token))
            if self._extend(self._decode().rstrip("\ufffd")):
                self.finish()
                raise _StopStringFound
        self._send(self._safe_end())

    def _extend(self, decoded: str) -> bool:
        """Append what ``decoded`` adds to the final text; cut it before a stop string that now appears (True)."""
        if len(decoded) <= len(self.text) or not decoded.startswith(self.text):
            return False
        start = max(0, len(self.text) - self.longest_stop + 1)          # a new hit ends in the appended part
        self.text = decoded
        hit = self._find_stop(self.text, start) if self.stop else None
        if hit is not None:
            self.text, self.stopped = self.text[:hit], True
        return hit is not None

    def _safe_end(self) -> int:
        """How much of ``text`` can be sent now: all but a tail that may start a stop string."""
        end = len(self.text)
        for n in range(min(self.longest_stop - 1, end), 0, -1):
            tail = self.text[end - n:]
            if any(s.startswith(tail) for s in self.stop):
                return end - n
        return end

    def _send(self, end: int) -> None:
        if end > self.sent:
            delta, self.sent = self.text[self.sent:end], end
            if self.on_text is not None:
                self.on_text(delta)

    def finish(self) -> None:
        """End of generation: the open tail is final now (searched for stop strings); send what is held back."""
        if not self.stopped:
            self._extend(self._decode())
        self._send(len(self.text))


def resolve_max_model_len(limit: tuple[str, int] | None, requested: int | None) -> int:
    """max_model_len: ``requested``, at most (and by default) the target's declared position limit ``limit``
    (``target.position_limit``: ``(config key, positions)``).

    Raises:
        ValueError: ``requested`` outside 1..limit, or missing when the target declares no limit.
    """
    if limit is None:
        if requested is None or requested < 1:
            raise ValueError(f"the target's config declares no position limit (none of "
                             f"{', '.join(POSITION_LIMIT_KEYS)}): pass max_model_len (--max-model-len N)")
        return int(requested)
    key, n = limit
    if requested is not None and not 0 < requested <= n:
        raise ValueError(f"max_model_len must be in 1..{n} (the target's {key}), got {requested}")
    return int(requested or n)


def check_draft_positions(draft_model, name: str, max_model_len: int, warn: bool = True) -> None:
    """Refuse a draft whose learned position table is shorter than ``max_model_len`` (a longer request would index
    past it: IndexError mid-request); a RoPE / ALiBi draft declaring fewer positions is served with a warning.
    vLLM likewise bounds the draft by min(draft length, max_model_len) (``vllm/config/speculative.py``,
    ``_maybe_override_draft_max_model_len``). ``draft_model`` may live on the meta device (checked before loading;
    ``warn=False`` leaves the warning to the engine's own check).

    Raises:
        ValueError: naming the draft's config key and length, max_model_len and the fix (``--max-model-len``).
    """
    limit = position_limit(draft_model.config)
    if limit is None or limit[1] >= max_model_len:
        return
    key, n = limit
    if has_learned_positions(draft_model):
        raise ValueError(f"the draft model {name!r} has learned positions for {key}={n} tokens, fewer than "
                         f"max_model_len={max_model_len}: a request longer than {n} tokens would index past its "
                         f"position table. Serve with --max-model-len {n} (max_model_len={n}), or use a draft with "
                         f"{key} >= {max_model_len}")
    if warn:
            logger.warning("the draft model %r declares %s=%d, fewer than max_model_len=%d: past %d tokens it drafts "
                       "at positions it was not trained on (output unchanged, acceptance may drop); --max-model-len "
                       "%d stays within it", name, key, n, max_model_len, n, n)


def _check_draft_before_loading(target: str, spec: "SpeculativeConfig", max_model_len: int | None,
                                revision: str | None) -> None:
    """``check_draft_positions`` from the configs alone (the draft built on the meta device), so that a draft the
    engine would refuse is refused before the target's weights are loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftsmith import reference

    target_config = AutoConfig.from_pretrained(reference.resolve(target), revision=revision)
    draft_config = AutoConfig.from_pretrained(reference.resolve(spec.model))
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(draft_config)
    check_draft_positions(draft, spec.model, resolve_max_model_len(position_limit(target_config), max_model_len),
                          warn=False)


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    """EOS ids of the tokenizer and of the model's generation config (an int or a list)."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return tuple(sorted({int(i) for i in ids if i is not None}))


def _in_fast_dtype(head: torch.nn.Module, device: torch.device, what: str) -> torch.nn.Module:
    """``head`` in a dtype ``device`` computes natively: an export stored in bf16/fp16 runs in float32 on a
    CPU that emulates half precision (``precision.resolve_dtype`` 'auto'); the change is logged. Drafts stay
    lossless either way (verification uses the q the head computed)."""
    from draftsmith.precision import resolve_dtype

    stored = next(head.parameters()).dtype
    dtype, reason = resolve_dtype("auto", device, model_dtype=stored)
    if dtype != stored:
        logger.info("%s: computing in %s instead of its stored %s (%s)", what, dtype, stored, reason)
        head = head.to(dtype)
    return head


class Engine:
    """Serves one target (batch size 1), with or without speculation.

    Args:
        model: a transformers causal LM in eval mode (on its serving device).
        tokenizer: the target's tokenizer (decoding, chat template, stop strings).
        speculative_config: a ``SpeculativeConfig``, its dict or JSON string, or None (plain decoding).
        model_name: the name clients send as ``model`` (``/v1/models``).
        allow_mismatch: target identity fields a checked head / exported draft may differ in (as
            ``load_eagle3``; CLI ``--allow-mismatch``).
        max_model_len: longest prompt + completion served, in tokens (default and upper bound: the target's
            declared position limit, ``max_position_embeddings`` or ``n_positions``; as vLLM's ``--max-model-len``).

    Raises:
        ValueError: a bad speculative config or max_model_len; a draft model whose tokenizer or vocabulary is
            not the target's, or whose learned position table is shorter than max_model_len;
            num_speculative_tokens above an MLP speculator's n_predict. ``HeadMismatchError`` (a ValueError):
            an EAGLE-3 head or MLP speculator that does not fit the target.
    """

    def __init__(self, model, tokenizer, speculative_config=None, *, model_name: str = "draftsmith",
                 allow_mismatch: Sequence[str] = (), max_model_len: int | None = None):
        self.spec = SpeculativeConfig.parse(speculative_config)
        self.tokenizer, self.model_name = tokenizer, model_name
        self.head = self.draft_model = None
        aux_layer_ids = None
        device = next(model.parameters()).device
        if self.spec is not None and self.spec.method == "eagle3":
            from draftsmith.export.check import load_eagle3

            from .proposers.eagle3 import warn_beyond_trained_depth

            head, meta = load_eagle3(self.spec.model, target_model=model, tokenizer=tokenizer,
                                     allow_mismatch=allow_mismatch)
            head = _in_fast_dtype(head.to(device), device, f"the EAGLE-3 head {self.spec.model!r}")
            head.bind_embedding(model.get_input_embeddings())
            self.head, aux_layer_ids = head, head.config.aux_layer_ids
            ttt_steps = meta.ttt_steps if meta.ttt_steps is not None else head.config.ttt_steps
            warn_beyond_trained_depth(self.spec.num_speculative_tokens, ttt_steps,
                                      f"the EAGLE-3 head {self.spec.model!r}")
        elif self.spec is not None and self.spec.method == "mlp_speculator":
            from draftsmith.export.mlp_speculator import load_mlp_speculator

            head, _ = load_mlp_speculator(self.spec.model, target_model=model, tokenizer=tokenizer,
                                          allow_mismatch=allow_mismatch)
            if self.spec.num_speculative_tokens > head.config.n_predict:
                raise ValueError(f"speculative config: num_speculative_tokens {self.spec.num_speculative_tokens} > "
                                 f"the MLP speculator's n_predict {head.config.n_predict} (it drafts one token per "
                                 f"stage); use num_speculative_tokens <= {head.config.n_predict}")
            self.head = _in_fast_dtype(head.to(device), device, f"the MLP speculator {self.spec.model!r}")
        elif self.spec is not None and self.spec.method == "draft_model":
            from draftsmith.models import load_causal_lm

            if (Path(self.spec.model) / HEAD_METADATA_FILE).is_file():     # exported by draftsmith: its target
                from draftsmith.export.draft_model import check_draft_model

                check_draft_model(self.spec.model, model, tokenizer, allow_mismatch=allow_mismatch)
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            draft, draft_tokenizer = load_causal_lm(self.spec.model, dtype=dtype, role="draft model")
            check_same_tokenizer(tokenizer, draft_tokenizer)
            self.draft_model = draft.to(device)
        self.target = TargetModel(model, tokenizer, aux_layer_ids=aux_layer_ids)
        if self.draft_model is not None:
            DraftModelProposer(self.draft_model, self.target.vocab_size)   # refuses a vocab size mismatch now
        self.k = self.spec.num_speculative_tokens if self.spec is not None else 0
        self.max_model_len = resolve_max_model_len(self.target.position_limit, max_model_len)
        if self.draft_model is not None:
            check_draft_positions(self.draft_model, self.spec.model, self.max_model_len)
        if self.head is not None and self.spec.method == "eagle3":
            self._check_head_positions()
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.metrics = EngineMetrics(self.k)
        self._lock = threading.Lock()

    def _check_head_positions(self) -> None:
        """An EAGLE-3 head (RoPE, computed per position) declaring fewer positions than max_model_len runs past
        them untrained: a warning, not a refusal (vLLM serves it to the target's length)."""
        n = int(self.head.config.max_position_embeddings)
        if n < self.max_model_len:
            logger.warning("the EAGLE-3 head %r declares max_position_embeddings=%d, fewer than max_model_len=%d: "
                           "past %d tokens it drafts at positions it was not trained on (output unchanged, acceptance "
                           "may drop); --max-model-len %d stays within it", self.spec.model, n, self.max_model_len,
                           n, n)

    @classmethod
    def from_pretrained(cls, target: str, speculative_config=None, *, revision: str | None = None,
                        dtype: str = "float32", device: str | None = None, served_model_name: str | None = None,
                        allow_mismatch: Sequence[str] = (), max_model_len: int | None = None,
                        check_memory: bool = True) -> "Engine":
        """Load ``target`` (a Hub id, a folder, or ``reference``) on ``device`` (default: cuda when
        available) and build the engine; ``served_model_name`` defaults to ``target``.

        Before loading, a draft model's position table is checked against max_model_len from the configs
        (``check_draft_positions``), and ``inference.memory.plan_for_engine`` estimates weights + KV caches of the
        target and the drafter for ``max_model_len`` and compares them with the device's free memory
        (``check_memory=False`` skips it).

        Raises:
            MemoryPlanError (a ValueError): the plan does not fit; the message says what to change.
            ValueError: as ``Engine`` (a draft's learned position table shorter than max_model_len, ...).
        """
        from draftsmith.models import load_causal_lm, resolve_model_dtype

        from .memory import plan_for_engine

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_model_dtype(target, dtype, revision, device)        # 'auto' -> what the device runs fast
        speculative_config = SpeculativeConfig.parse(speculative_config)
        if speculative_config is not None and speculative_config.method == "draft_model":
            _check_draft_before_loading(target, speculative_config, max_model_len, revision)
        if check_memory:
            plan = plan_for_engine(target, speculative_config, dtype=dtype, device=device,
                                   max_model_len=max_model_len, revision=revision)
            logger.info("%s", plan.summary())
            plan.check()
        model, tokenizer = load_causal_lm(target, revision=revision, dtype=dtype, role="target")
        model.to(device)
        return cls(model, tokenizer, speculative_config, model_name=served_model_name or target,
                   allow_mismatch=allow_mismatch, max_model_len=max_model_len)

    def check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Refuse (``RequestError``) an empty prompt, ids outside the vocabulary, or prompt + max_new_tokens
        beyond ``max_model_len``."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty (0 tokens)", "invalid_prompt", "prompt")
        vocab_size = self.target.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                               "invalid_prompt", "prompt")
        if n + max_new_tokens > self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                               f"{n + max_new_tokens} were requested ({n} in the prompt, {max_new_tokens} for the "
                               f"completion); shorten the prompt or lower max_tokens",
                               "context_length_exceeded", "max_tokens" if n < self.max_model_len else "prompt")

    def new_proposer(self, cfg: GenerationConfig) -> Proposer | None:
        """A fresh proposer for one sequence (drafts sampled with the request's settings)."""
        if self.spec is None:
            return None
        if self.spec.method == "ngram":
            return NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        # the drafter's generator must not replay the target's random stream (same seed -> correlated draws)
        seed = None if cfg.seed is None else (cfg.seed + DRAFT_SEED_OFFSET) % 2**63
        sampling = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
        if self.spec.method == "draft_model":
            return DraftModelProposer(self.draft_model, self.target.vocab_size, **sampling)
        if self.spec.method == "mlp_speculator":
            from .proposers.mlp_speculator import MLPSpeculatorProposer

            return MLPSpeculatorProposer(self.head, **sampling)
        from .proposers.eagle3 import Eagle3Proposer

        return Eagle3Proposer(self.head, **sampling)

    def generate(self, prompt_ids: Sequence[int], cfg: GenerationConfig, *, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None,
                 arrival: float | None = None) -> EngineResult:
        """Generate one sequence (waiting for the requests ahead of it), record its metrics.

        Args:
            prompt_ids: ``[T]`` token ids. cfg: decoding settings (EOS ids are the caller's to set;
                ``self.eos_token_ids`` are the model's).
            stop: stop strings, found on the decoded text. on_text: called with each new piece of text.
            cancel: when set, generation stops at the next chunk with ``RequestCancelled``.
            arrival: ``time.perf_counter()`` when the request arrived (TTFT and latency count from it;
                default: now).

        Raises:
            RequestError: the prompt fails ``check_prompt``. RequestCancelled: ``cancel`` was set.
        """
        arrival = time.perf_counter() if arrival is None else arrival
        prompt = [int(t) for t in prompt_ids]
        self.check_prompt(prompt, cfg.max_new_tokens)
        with self._lock:
            proposer = self.new_proposer(cfg)
            counting = _CountingProposer(proposer, self.k) if proposer is not None else None
            text = TextStream(self.tokenizer, stop, on_text)
            first_token_at = None

            def on_tokens(chunk: list[int]) -> None:
                nonlocal first_token_at
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                if cancel is not None and cancel.is_set():
                    raise RequestCancelled
                text.add(chunk)

            try:
                if counting is None:
                    result = generate_plain(self.target, prompt, cfg, on_tokens=on_tokens)
                else:
                    result = generate_speculative(self.target, counting, prompt, cfg, self.k, on_tokens=on_tokens)
                finish_reason, forwards = result.finish_reason, result.num_target_forwards
            except _StopStringFound:
                finish_reason = "stop"
                forwards = 1 + counting.verify_steps if counting is not None else len(text.tokens)
            finally:
                if counting is not None:
                    self.metrics.record_spec(counting.stats)
            text.finish()
            if text.stopped:                  # found in the tail that only the end of generation made final
                finish_reason = "stop"
        latency = time.perf_counter() - arrival
        ttft = first_token_at - arrival if first_token_at is not None else None
        self.metrics.record_request(len(prompt), len(text.tokens), finish_reason, ttft, latency)
        return EngineResult(tokens=text.tokens, finish_reason=finish_reason,
                            stats=counting.stats if counting is not None else None, num_target_forwards=forwards,
                            text=text.text, prompt_tokens=len(prompt), ttft_s=ttft, latency_s=latency)
