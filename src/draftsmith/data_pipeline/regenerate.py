"""Regenerate assistant turns with the target itself, so the head learns the target's own answers.

    answerer = make_answerer("transformers", target, tokenizer, "reference")      # or "draftsmith",
    # or ServerAnswerer("http://127.0.0.1:8000", "meta-llama/Llama-3.1-8B-Instruct")  (vLLM, draftsmith serve)
    convs = regenerate(answerer, conversations, max_new_tokens=192, temperature=0.0, batch_size=16,
                       journal=Path("runs/NAME/data/regenerate.partial.jsonl"))

Each assistant turn is replaced, turn by turn, by the target's answer to the conversation so far
(earlier turns already regenerated). Three engines answer:

  transformers   batched ``generate`` with left padding, in process; the default: on the reference
                 target 16 answers batched took 29 s against 160 s one at a time through the runtime,
                 with identical greedy text (CPU, 1 thread; the runtime then decoded batch 1);
  draftsmith     draftsmith's own runtime (``core.batch.generate_batch``: a call's prompts decoded
                 together, continuous batching), exactly the decoding path ``draftsmith serve`` uses;
  server         an OpenAI-compatible server (vLLM, ``draftsmith serve``) given its URL:
                 ``POST /v1/chat/completions``, one request per answer, ``batch_size`` in flight.

Every output conversation records who wrote its answers under ``provenance.regenerated_by``
(engine, model name and revision, decoding settings) and ``provenance.unfinished`` (an answer hit
``max_new_tokens``). A conversation given an empty answer is left out, with its reason
(``regenerate_with_drops``) and a warning.

Resume. With a ``journal`` path, every finished batch of answers is appended to that jsonl file
(flushed and fsynced) under a key: the sha256 of the inputs, the decoding settings and the engine's
identity. A rerun after a kill replays the journal and answers only the batches it lacks; a journal
with another key is discarded; a torn last line is dropped. Batches have a fixed composition (the
turn's conversations in input order, cut every ``batch_size``) and every answer its own seed
``answer_seed(seed, conversation, turn)``, so a resumed run writes what an uninterrupted one would.
The caller deletes the journal once its final files are written (``prepare`` does, after its
manifest).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from draftsmith.core.batch import generate_batch
from draftsmith.core.generate import GenerationConfig
from draftsmith.core.stops import stop_token_ids
from draftsmith.core.target import TargetModel
from draftsmith.data_pipeline.chat import prompt_ids, render_text
from draftsmith.data_pipeline.drops import SkippedRecord, log_dropped
from draftsmith.identity import canonical_json

logger = logging.getLogger(__name__)
ENGINES = ("transformers", "draftsmith", "server")
JOURNAL_FORMAT = "draftsmith-regenerate-journal"


@dataclass
class Answer:
    """One regenerated answer: its text (special tokens skipped) and whether it ended on a stop token."""

    text: str
    finished: bool


class Answerer(Protocol):
    """What regenerates answers: a batch of conversation prefixes in, one ``Answer`` per prefix out."""

    def identity(self) -> dict:
        """Who answers: ``{"engine", "name_or_path", "revision", ...}`` (recorded in provenance and the key)."""

    def answer(
        self, prompts: list[list[dict]], max_new_tokens: int, temperature: float, seeds: list[int]
    ) -> list[Answer]:
        """Answers to ``prompts`` (each a message list ending with a user or tool turn), in order.

        ``temperature`` 0 is greedy; ``seeds[i]`` seeds prompt i's sampling."""


def answer_seed(seed: int, conversation: int, turn: int) -> int:
    """Seed [0, 2**31) of the answer to turn ``turn`` of conversation ``conversation`` under run seed ``seed``."""
    digest = hashlib.sha256(f"{seed}:{conversation}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class TransformersAnswerer:
    """Batched transformers decoding (left padding), in process, stopping on the runtime's EOS ids: greedy by
    ``greedy`` (rows leave the batch as they stop), sampling by ``generate``.

    Sampling draws from one generator per batch, seeded with the batch's first seed, so a sampled
    answer depends on its batch; ``regenerate`` keeps batches fixed, so reruns agree."""

    def __init__(self, model, tokenizer, name_or_path: str, revision: str | None = None):
        self.model, self.tokenizer, self.name_or_path, self.revision = model, tokenizer, name_or_path, revision
        self.eos_token_ids = stop_token_ids(model, tokenizer)  # the stop ids the runtime uses

    def identity(self) -> dict:
        """``{"engine": "transformers", "name_or_path", "revision"}``."""
        return {"engine": "transformers", "name_or_path": self.name_or_path, "revision": self.revision}

    @torch.no_grad()
    def answer(
        self, prompts: list[list[dict]], max_new_tokens: int, temperature: float, seeds: list[int]
    ) -> list[Answer]:
        """Answers to ``prompts`` (see ``Answerer.answer``); the batch is left-padded to its longest prompt."""
        tokenizer = self.tokenizer
        texts = [render_text(tokenizer, m, add_generation_prompt=True) for m in prompts]
        enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, enc))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        device = next(self.model.parameters()).device
        ids = torch.full((len(enc), width), pad, dtype=torch.long)  # [B, T], prompts right-aligned
        attn = torch.zeros_like(ids)
        for i, e in enumerate(enc):
            ids[i, width - len(e) :] = torch.tensor(e)
            attn[i, width - len(e) :] = 1
        if temperature > 0:
            torch.manual_seed(seeds[0])
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=temperature,
                top_p=None,
                top_k=None,
                eos_token_id=list(self.eos_token_ids),
                pad_token_id=pad,
            )
            rows = out[:, width:].tolist()
        else:
            rows = self.greedy(ids.to(device), attn.to(device), max_new_tokens)
        answers = []
        for row in rows:
            stop = next((i for i, t in enumerate(row) if t in self.eos_token_ids), None)
            finished = stop is not None
            answers.append(Answer(tokenizer.decode(row[:stop], skip_special_tokens=True), finished))
        return answers

    @torch.no_grad()
    def greedy(self, ids: torch.Tensor, attn: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of a left-padded batch (``ids``, ``attn``: ``[B, T]``), each ending at its first
        stop id (kept) or after ``max_new_tokens``; ``[B]`` lists of token ids.

        A row leaves the batch as soon as it stops (its KV-cache rows are dropped:
        ``DynamicCache.batch_select_indices``), so the decode work follows each answer's length instead of
        the batch's longest (on the demo's 2,400 answers, fixed batches of 48 decode 1.7x the tokens kept).
        Positions count real tokens only (``attention_mask.cumsum - 1``), as transformers' ``generate``
        does; the tokens are ``generate(do_sample=False)``'s up to the float rounding of smaller batches
        (``tests/test_regenerate.py`` compares them)."""
        model = self.model
        cache = DynamicCache(config=model.config)
        stops = set(self.eos_token_ids)
        out: list[list[int]] = [[] for _ in range(ids.shape[0])]
        rows = list(range(ids.shape[0]))  # batch position -> answer index
        position = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position, cache=cache, use_cache=True).logits
        position = position[:, -1:]
        for _ in range(max_new_tokens):
            tokens = logits[:, -1].argmax(-1)  # [B']
            keep = []
            for j, (row, token) in enumerate(zip(rows, tokens.tolist())):
                out[row].append(token)
                if token not in stops and len(out[row]) < max_new_tokens:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=ids.device)
                cache.batch_select_indices(index)
                attn, tokens, position = attn[index], tokens[index], position[index]
                rows = [rows[j] for j in keep]
            attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
            position = position + 1
            logits = model(
                input_ids=tokens[:, None], attention_mask=attn, position_ids=position, cache=cache, use_cache=True
            ).logits
        return out


class RuntimeAnswerer:
    """draftsmith's runtime: the prompts of a call decoded together (``core.batch.generate_batch``: continuous
    batching, each answer as it would be alone, with its own seed).

    The prompt is tokenized as ``draftsmith serve`` does (``chat.prompt_ids``) and generation stops on
    the tokenizer's and the generation config's EOS ids, as the engine does."""

    def __init__(self, model, tokenizer, name_or_path: str, revision: str | None = None):

        self.target = TargetModel(model, tokenizer)
        self.tokenizer, self.name_or_path, self.revision = tokenizer, name_or_path, revision
        self.eos_token_ids = stop_token_ids(model, tokenizer)

    def identity(self) -> dict:
        """``{"engine": "draftsmith", "name_or_path", "revision"}``."""
        return {"engine": "draftsmith", "name_or_path": self.name_or_path, "revision": self.revision}

    def answer(
        self, prompts: list[list[dict]], max_new_tokens: int, temperature: float, seeds: list[int]
    ) -> list[Answer]:
        """Answers to ``prompts`` (see ``Answerer.answer``), decoded in one batch."""

        cfgs = [
            GenerationConfig(
                max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_token_ids=self.eos_token_ids
            )
            for seed in seeds
        ]
        ids = [prompt_ids(self.tokenizer, messages) for messages in prompts]
        answers = []
        for result in generate_batch(self.target, None, ids, cfgs, max_num_seqs=max(1, len(ids))):
            finished = result.finish_reason == "stop"
            tokens = result.tokens[:-1] if finished else result.tokens  # the stop token is not text
            answers.append(Answer(self.tokenizer.decode(tokens, skip_special_tokens=True), finished))
        return answers


class ServerError(RuntimeError):
    """An OpenAI-compatible server that cannot be reached or refuses a request (message names the URL)."""


class ServerAnswerer:
    """An OpenAI-compatible server (vLLM ``vllm serve``, ``draftsmith serve``) at ``url``.

    Args:
        url: base URL, with or without the ``/v1`` suffix (``http://127.0.0.1:8000``).
        target_name: the recipe's target; picks the served model when the server lists several
            (by ``id`` or vLLM's ``root``), and is compared with what it serves (a mismatch is logged).
        revision: the target revision the user declares the server runs (servers do not report it).
        timeout_s: per request. retries: further attempts after a connection error or a 5xx answer.

    Requests are ``POST /v1/chat/completions`` with ``messages``, ``max_tokens``, ``temperature`` and
    ``seed``; the answer is ``choices[0].message.content`` and it is finished when ``finish_reason`` is
    ``"stop"``. Start vLLM without ``--reasoning-parser``, so think blocks stay in the content.

    Raises:
        ServerError: the server cannot be reached, serves no model, or refuses a request.
    """

    def __init__(
        self, url: str, target_name: str, revision: str | None = None, timeout_s: float = 600.0, retries: int = 2
    ):
        base = url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.timeout_s, self.retries, self.revision = timeout_s, retries, revision
        served = self._request("GET", "/v1/models").get("data") or []
        if not served:
            raise ServerError(f"{self.base}/v1/models lists no model")
        pick = [m for m in served if target_name in (m.get("id"), m.get("root"))]
        if len(served) > 1 and not pick:
            raise ServerError(f"{self.base} serves {[m.get('id') for m in served]}; none is {target_name!r}")
        model = (pick or served)[0]
        self.model, self.root = model.get("id"), model.get("root")
        if not pick:
            logger.warning(
                "%s serves %r, not the recipe's target %r: regenerated answers are recorded as %r's",
                self.base,
                self.model,
                target_name,
                self.model,
            )

    def identity(self) -> dict:
        """``{"engine": "server", "url", "name_or_path" (served id), "root" (vLLM), "revision" (declared)}``."""
        return {
            "engine": "server",
            "url": self.base,
            "name_or_path": self.model,
            "root": self.root,
            "revision": self.revision,
        }

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(
                self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code < 500 or attempt == self.retries:
                    raise ServerError(f"{method} {self.base}{path} answered {e.code}: {detail}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                if attempt == self.retries:
                    raise ServerError(f"{method} {self.base}{path} failed: {e}") from None
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def _one(self, messages: list[dict], max_new_tokens: int, temperature: float, seed: int) -> Answer:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            "n": 1,
            "stream": False,
        }
        out = self._request("POST", "/v1/chat/completions", body)
        choice = out["choices"][0]
        return Answer(choice["message"].get("content") or "", choice.get("finish_reason") == "stop")

    def answer(
        self, prompts: list[list[dict]], max_new_tokens: int, temperature: float, seeds: list[int]
    ) -> list[Answer]:
        """Answers to ``prompts`` (see ``Answerer.answer``): one request each, all in flight at once."""
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            return list(pool.map(lambda p, s: self._one(p, max_new_tokens, temperature, s), prompts, seeds))


def make_answerer(
    engine: str, model, tokenizer, name_or_path: str, revision: str | None = None, url: str | None = None
) -> Answerer:
    """The answerer for ``engine`` (one of ``ENGINES``); ``server`` needs ``url``.

    Raises ValueError for an unknown engine or a server engine without a URL; ServerError when the
    server cannot be reached."""
    if engine == "transformers":
        return TransformersAnswerer(model, tokenizer, name_or_path, revision)
    if engine == "draftsmith":
        return RuntimeAnswerer(model, tokenizer, name_or_path, revision)
    if engine == "server":
        if not url:
            raise ValueError("regeneration engine 'server' needs the server's URL (data.regenerate_url)")
        return ServerAnswerer(url, name_or_path, revision)
    raise ValueError(f"regeneration engine {engine!r} is not one of {ENGINES}")


# --------------------------------------------------------------------------------------------- journal


def _journal_key(conversations: list[dict], identity: dict, settings: dict) -> str:
    """sha256 over what the answers depend on (the server's URL excluded: the model is what counts)."""
    h = hashlib.sha256(
        canonical_json({"identity": {k: v for k, v in identity.items() if k != "url"}, "settings": settings})
    )
    for conv in conversations:
        h.update(canonical_json(conv["messages"]))
        h.update(b"\n")
    return h.hexdigest()


def _read_journal(path: Path, key: str) -> dict[tuple[int, int], Answer]:
    """Answers recorded under ``key`` by (conversation, turn); rewrites the file without a torn tail.

    A journal written under another key is discarded (logged), so the file then holds only the header."""
    done: dict[tuple[int, int], Answer] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a kill mid-write: the rest is lost
    if records and records[0].get("format") == JOURNAL_FORMAT and records[0].get("key") == key:
        for r in records[1:]:
            done[(int(r["conversation"]), int(r["turn"]))] = Answer(r["content"], bool(r["finished"]))
    elif records:
        logger.warning("%s was written for other inputs or settings; starting regeneration over", path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"format": JOURNAL_FORMAT, "key": key}) + "\n")
        for (ci, turn), a in sorted(done.items()):
            f.write(json.dumps({"conversation": ci, "turn": turn, "content": a.text, "finished": a.finished}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return done


def _append(path: Path, entries: list[tuple[int, int, Answer]]) -> None:
    """Append one batch of answers (conversation, turn, answer) and make it durable."""
    with open(path, "a") as f:
        f.write(
            "".join(
                json.dumps({"conversation": ci, "turn": turn, "content": a.text, "finished": a.finished}) + "\n"
                for ci, turn, a in entries
            )
        )
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------- regeneration


def _prompt_chars(messages: list[dict]) -> int:
    """Length of a prompt in characters of content (a tokenizer-free proxy for its token count)."""
    return sum(len(m.get("content") or "") for m in messages)


@dataclass
class Regenerated:
    """What :func:`regenerate_with_drops` returns: the regenerated conversations, the input index of
    each (``kept``), and the conversations left out with their reasons (``dropped``; kinds
    ``empty_regenerated_answer``, ``unfinished_regenerated_answer``)."""

    conversations: list[dict]
    kept: list[int]
    dropped: list[SkippedRecord]


def regenerate(
    answerer: Answerer,
    conversations: list[dict],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 16,
    seed: int = 0,
    drop_unfinished: bool = False,
    journal: str | Path | None = None,
    progress: bool = True,
) -> list[dict]:
    """The conversations of :func:`regenerate_with_drops`; a warning names those it left out, by reason."""
    out = regenerate_with_drops(
        answerer,
        conversations,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
        seed=seed,
        drop_unfinished=drop_unfinished,
        journal=journal,
        progress=progress,
    )
    log_dropped(logger, "regenerate", out.dropped, len(conversations))
    return out.conversations


def regenerate_with_drops(
    answerer: Answerer,
    conversations: list[dict],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 16,
    seed: int = 0,
    drop_unfinished: bool = False,
    journal: str | Path | None = None,
    progress: bool = True,
) -> Regenerated:
    """Copies of ``conversations`` whose assistant turns are ``answerer``'s answers, and what was left out.

    Steps:
      1. key the run (inputs, settings, answerer identity); replay ``journal`` answers made under it;
      2. for turn t = 0, 1, ...: the conversations with a (t+1)-th assistant turn, ordered by prompt
         length (characters; ties by input order) so that left padding wastes little, cut into fixed
         batches of ``batch_size``; each batch not fully in the journal is answered from
         the conversation so far (earlier turns regenerated) and appended to the journal;
      3. conversations with an empty answer are left out, and those with an answer that hit
         ``max_new_tokens`` too when ``drop_unfinished`` (else kept, ``provenance.unfinished``);
         each with its reason in ``Regenerated.dropped`` (the caller reports them; ``regenerate`` logs).
    Order is preserved. Raises ValueError for batch_size < 1 or max_new_tokens < 1; the answerer's
    errors (e.g. ServerError) propagate, leaving finished batches in the journal."""
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    convs = [{**c, "messages": [dict(m) for m in c["messages"]]} for c in conversations]
    settings = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "batch_size": batch_size,
        "seed": seed,
        "batch_order": "prompt_length",
    }
    identity = answerer.identity()
    path = Path(journal) if journal is not None else None
    done = _read_journal(path, _journal_key(conversations, identity, settings)) if path else {}

    slots = [[j for j, m in enumerate(c["messages"]) if m["role"] == "assistant"] for c in convs]
    max_turns = max(map(len, slots), default=0)
    turns = [
        sorted(
            (ci for ci in range(len(convs)) if turn < len(slots[ci])),  # similar lengths batched
            key=lambda ci: (_prompt_chars(convs[ci]["messages"][: slots[ci][turn]]), ci),
        )
        for turn in range(max_turns)
    ]
    batches = [
        (turn, todo[b : b + batch_size]) for turn, todo in enumerate(turns) for b in range(0, len(todo), batch_size)
    ]
    unfinished: set[int] = set()
    bar = tqdm(total=len(batches), desc="regenerate", disable=not progress)
    for turn, batch in batches:  # step 2
        answers = [done.get((ci, turn)) for ci in batch]
        if any(a is None for a in answers):
            prompts = [convs[ci]["messages"][: slots[ci][turn]] for ci in batch]
            answers = answerer.answer(
                prompts, max_new_tokens, temperature, [answer_seed(seed, ci, turn) for ci in batch]
            )
            if path is not None:
                _append(path, [(ci, turn, a) for ci, a in zip(batch, answers)])
        for ci, a in zip(batch, answers):
            convs[ci]["messages"][slots[ci][turn]]["content"] = a.text
            if not a.finished:
                unfinished.add(ci)
        bar.update(1)
        bar.set_postfix(turn=f"{turn + 1}/{max_turns}")
    bar.close()

    regenerated_by = {**identity, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    out = Regenerated([], [], [])
    for ci, c in enumerate(convs):  # step 3
        empty = next((t for t, j in enumerate(slots[ci]) if not c["messages"][j]["content"].strip()), None)
        if empty is not None:
            out.dropped.append(
                SkippedRecord(ci, f"conversation {ci}: the answer to turn {empty} is empty", "empty_regenerated_answer")
            )
            continue
        if drop_unfinished and ci in unfinished:
            out.dropped.append(
                SkippedRecord(
                    ci,
                    f"conversation {ci}: an answer hit max_new_tokens {max_new_tokens}",
                    "unfinished_regenerated_answer",
                )
            )
            continue
        prov = dict(c.get("provenance") or {})
        prov["regenerated_by"] = regenerated_by
        prov["unfinished"] = ci in unfinished
        out.conversations.append({**c, "provenance": prov})
        out.kept.append(ci)
    return out
