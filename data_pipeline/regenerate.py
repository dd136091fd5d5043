"""Regenerate assistant turns with the target itself, so the head learns the target's own answers.

Each assistant turn is replaced, turn by turn, by the target's answer to the conversation so far
(earlier turns already regenerated). Generation is batched with left padding through transformers'
``generate`` (greedy, or sampled with a temperature). Every output conversation records which model
and revision wrote it under ``provenance.regenerated_by``.
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from draftsmith.data_pipeline.chat import render_text


@torch.no_grad()
def _answer_batch(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, temperature: float,
                  generator_seed: int) -> list[tuple[str, bool]]:
    texts = [render_text(tokenizer, m, add_generation_prompt=True) for m in prompts]
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, enc))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(enc), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e)
        attn[i, width - len(e):] = 1
    torch.manual_seed(generator_seed)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                         do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                         top_p=None, top_k=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    answers = []
    for row in out[:, width:]:
        row = row.tolist()
        finished = tokenizer.eos_token_id in row
        if finished:
            row = row[: row.index(tokenizer.eos_token_id)]
        answers.append((tokenizer.decode(row, skip_special_tokens=True), finished))
    return answers


def regenerate(model, tokenizer, conversations: list[dict], name_or_path: str, revision: str | None = None,
               max_new_tokens: int = 256, temperature: float = 0.0, batch_size: int = 16, seed: int = 0,
               drop_unfinished: bool = False) -> list[dict]:
    """Return copies of ``conversations`` whose assistant turns are the target's own answers.

    Conversations whose answers hit ``max_new_tokens`` are kept (``provenance.unfinished``) unless
    ``drop_unfinished``; answers that come out empty are dropped. Order is preserved."""
    convs = [{**c, "messages": [dict(m) for m in c["messages"]]} for c in conversations]
    unfinished = set()
    max_turns = max((sum(m["role"] == "assistant" for m in c["messages"]) for c in convs), default=0)
    for turn in range(max_turns):
        todo = []   # (conversation index, message index)
        for ci, c in enumerate(convs):
            idx = [j for j, m in enumerate(c["messages"]) if m["role"] == "assistant"]
            if turn < len(idx):
                todo.append((ci, idx[turn]))
        bar = tqdm(range(0, len(todo), batch_size), desc=f"regenerate turn {turn + 1}/{max_turns}")
        for b in bar:
            chunk = todo[b:b + batch_size]
            answers = _answer_batch(model, tokenizer, [convs[ci]["messages"][:j] for ci, j in chunk],
                                    max_new_tokens, temperature, seed + b)
            for (ci, j), (text, finished) in zip(chunk, answers):
                convs[ci]["messages"][j]["content"] = text
                if not finished:
                    unfinished.add(ci)
    out = []
    for ci, c in enumerate(convs):
        if any(m["role"] == "assistant" and not m["content"].strip() for m in c["messages"]):
            continue
        if drop_unfinished and ci in unfinished:
            continue
        prov = dict(c.get("provenance") or {})
        prov["regenerated_by"] = {"name_or_path": name_or_path, "revision": revision,
                                  "max_new_tokens": max_new_tokens, "temperature": temperature}
        prov["unfinished"] = ci in unfinished
        out.append({**c, "provenance": prov})
    return out
