"""``draftsmith prepare``: conversations -> (regenerated) training conversations + draft vocab map.

Steps:
  1. load and normalise conversations (``dataset.load_conversations``);
  2. optionally regenerate every assistant turn with the target (``regenerate.regenerate``): in process
     (batched transformers generate, or draftsmith's runtime) or through an OpenAI-compatible server
     (vLLM) at ``regenerate_url``; finished batches go to ``regenerate.partial.jsonl``, so a killed
     prepare resumes where it stopped;
  3. split off the held-out conversations; render the others with the target's chat template and
     assistant-only mask, cut to ``max_length`` (a cut answer still trains on its first tokens);
  4. account for every selected conversation left out (``drops``: empty regenerated answers, template
     refusals under on_error=skip, no supervised token, none left within max_length): one warning by
     reason, and DroppedConversationsError when more than ``max_dropped_fraction`` of them is lost;
     nothing is written then and the regeneration journal stays, so a rerun (e.g. with a larger
     max_length) regenerates nothing again; refuse implausible masks;
  5. count supervised tokens -> top-Vd draft vocabulary (d2t/t2d), EOS always included;
  6. write ``conversations.jsonl``, ``vocab_map.safetensors`` and ``manifest.json`` (config, counts,
     what was left out by reason, sha256 of every file, the target's identity) into the output folder,
     each atomically; then delete the regeneration journal.
A folder whose manifest was written by the same config is reused as is (its losses checked against
today's ``max_dropped_fraction``, which does not key the folder).

Manifest counts: ``records_read`` (records in the source), ``malformed_records`` (skipped while loading
under on_error=skip, over the whole source), ``conversations_selected`` (taken after shuffling:
num_conversations + heldout_conversations, or fewer when the source runs out) =
``conversations`` + ``heldout_conversations`` + the sum of ``dropped`` ({reason: count}, examples in
``dropped_examples``); ``dropped_fraction`` = that sum / conversations_selected; ``skipped_records`` =
malformed_records + that sum (every record left out, other than by the num_conversations cut).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from draftsmith.config import to_dict
from draftsmith.data_pipeline.config import DataConfig
from draftsmith.data_pipeline.dataset import check_supervised_fraction, read_conversations, render_conversations
from draftsmith.data_pipeline.drops import (
    SkippedRecord,
    check_dropped_share,
    count_by_reason,
    examples_by_reason,
    log_dropped,
)
from draftsmith.data_pipeline.regenerate import make_answerer, regenerate_with_drops
from draftsmith.data_pipeline.vocab import VocabMap, build_vocab_map, count_tokens

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """A prepared data folder: conversations (train / held-out split) and the vocab map."""

    folder: Path
    conversations: list[dict]
    heldout: list[dict]
    vocab_map: VocabMap
    manifest: dict


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# fields added after folders were first prepared, with the value that reproduces the earlier behaviour
LATER_FIELDS = {
    "regenerate_engine": "transformers",
    "regenerate_url": None,
    "split": "train",
    "subset": None,
    "on_error": "raise",
}
# fields that check a folder rather than make it: never in its key, checked again when it is reused
UNKEYED_FIELDS = ("max_dropped_fraction",)


def _key_fields(cfg: DataConfig) -> dict:
    """The config a prepared folder is keyed by; LATER_FIELDS at their old value are left out, so folders
    prepared before those fields existed are still reused, and UNKEYED_FIELDS always are."""
    return {
        k: v
        for k, v in to_dict(cfg).items()
        if k not in UNKEYED_FIELDS and (k not in LATER_FIELDS or LATER_FIELDS[k] != v)
    }


def _in_selection(records: list[SkippedRecord], selection_index: list[int]) -> list[SkippedRecord]:
    """``records`` of a stage that saw a sub-list, renumbered to the selection (``selection_index[i]``
    is the selection index of the stage's conversation i; reasons start ``"conversation {i}: "``)."""
    out = []
    for r in records:
        j, prefix = selection_index[r.index], f"conversation {r.index}:"
        reason = f"conversation {j}:" + r.reason[len(prefix) :] if r.reason.startswith(prefix) else r.reason
        out.append(dataclasses.replace(r, index=j, reason=reason))
    return out


def _check_dropped(manifest: dict, cfg: DataConfig) -> None:
    """DroppedConversationsError when a reused folder's losses exceed ``cfg.max_dropped_fraction``
    (manifests written before losses were counted pass)."""
    if "dropped" in manifest:
        check_dropped_share(
            manifest["dropped"],
            manifest["conversations_selected"],
            cfg.max_dropped_fraction,
            manifest["dropped_examples"],
        )


def prepare(
    cfg: DataConfig, target, tokenizer, target_name: str, out: Path, revision: str | None = None
) -> PreparedData:
    """Run the steps of the module docstring into folder ``out`` (or reuse it); returns the data.

    Raises DroppedConversationsError (a ValueError) when more than ``cfg.max_dropped_fraction`` of the
    selected conversations is left out, ValueError when none is left for training or the mask is
    implausible, DatasetError / FileNotFoundError for the source (``dataset.read_conversations``)."""
    out.mkdir(parents=True, exist_ok=True)
    key = json.dumps({"data": _key_fields(cfg), "target": target_name, "revision": revision}, sort_keys=True)
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and json.loads(manifest_path.read_text()).get("key") == key:
        data = load_prepared(out)
        _check_dropped(data.manifest, cfg)
        return data
    n = (cfg.num_conversations or 0) + cfg.heldout_conversations if cfg.num_conversations else None
    loaded = read_conversations(
        cfg.source, limit=n, seed=cfg.seed, on_error=cfg.on_error, split=cfg.split, subset=cfg.subset
    )
    convs = loaded.conversations
    selected = len(convs)
    if n is not None and selected < n:
        logger.warning(
            "%s holds %d usable conversations, fewer than the %d asked (data.num_conversations + "
            "data.heldout_conversations)",
            cfg.source,
            selected,
            n,
        )
    origin, dropped = list(range(selected)), []  # selection index of each conversation still in play
    journal = out / "regenerate.partial.jsonl"
    if cfg.regenerate:
        answerer = make_answerer(cfg.regenerate_engine, target, tokenizer, target_name, revision, cfg.regenerate_url)
        regen = regenerate_with_drops(
            answerer,
            convs,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            journal=journal,
        )
        convs, origin, dropped = regen.conversations, regen.kept, regen.dropped
    heldout, train = convs[: cfg.heldout_conversations], convs[cfg.heldout_conversations :]
    if not train:
        raise ValueError(
            f"no conversation is left for training: all {len(convs)} go to the held-out split "
            f"(data.heldout_conversations={cfg.heldout_conversations}); lower it, or raise "
            "data.num_conversations"
        )
    rendered = render_conversations(tokenizer, train, cfg.max_length, on_error=cfg.on_error)
    dropped += _in_selection(rendered.skipped, origin[cfg.heldout_conversations :])
    train = [train[i] for i in rendered.kept]  # later stages render what is kept
    dropped_counts, examples = count_by_reason(dropped), examples_by_reason(dropped)
    log_dropped(logger, "prepare", dropped, selected)
    kept_journal = (
        f" The regenerated answers stay in {journal}: a rerun regenerates only what is missing."
        if cfg.regenerate
        else ""
    )
    check_dropped_share(dropped_counts, selected, cfg.max_dropped_fraction, examples, kept_journal)
    check_supervised_fraction(rendered, tokenizer)
    vocab_size = len(tokenizer)
    counts = count_tokens(rendered.input_ids, rendered.loss_mask, vocab_size)
    vd = cfg.draft_vocab_size or vocab_size
    always = [i for i in {tokenizer.eos_token_id, tokenizer.pad_token_id} if i is not None]
    vmap = build_vocab_map(counts, min(vd, vocab_size), always_include=always)
    for name, records in (("conversations.jsonl", train), ("heldout.jsonl", heldout)):
        _write_atomic(out / name, "".join(json.dumps(r) + "\n" for r in records))
    tmp = out / "vocab_map.safetensors.tmp"
    save_file(vmap.to_tensors(), str(tmp))
    tmp.replace(out / "vocab_map.safetensors")
    seen = int((counts > 0).sum())
    covered = float(counts[vmap.t2d].sum()) / max(1.0, float(counts.sum()))
    manifest = {
        "key": key,
        "config": to_dict(cfg),
        "target": {"name_or_path": target_name, "revision": revision},
        "conversations": len(train),
        "heldout_conversations": len(heldout),
        "tokens": rendered.num_tokens(),
        "supervised_tokens": int(counts.sum()),
        "supervised_fraction": rendered.supervised_fraction(),
        "distinct_supervised_tokens": seen,
        "draft_vocab_size": vmap.draft_vocab_size,
        "draft_vocab_coverage": covered,
        "d2t_sha256": vmap.sha256(),
        "records_read": loaded.total,
        "malformed_records": len(loaded.skipped),
        "conversations_selected": selected,
        "dropped": dropped_counts,
        "dropped_fraction": len(dropped) / max(1, selected),
        "dropped_examples": examples,
        "truncated_conversations": rendered.truncated,
        "skipped_records": len(loaded.skipped) + len(dropped),
        "skipped_examples": [r.reason for r in (loaded.skipped + dropped)[:5]],
        "unfinished_answers": sum(bool((c.get("provenance") or {}).get("unfinished")) for c in train),
        "files": {p: _sha256(out / p) for p in ("conversations.jsonl", "heldout.jsonl", "vocab_map.safetensors")},
    }
    _write_atomic(manifest_path, json.dumps(manifest, indent=1))
    journal.unlink(missing_ok=True)  # the answers now live in conversations/heldout.jsonl
    return PreparedData(out, train, heldout, vmap, manifest)


def load_prepared(folder: Path) -> PreparedData:
    """Read a folder written by :func:`prepare`; raises ValueError if a file's sha256 changed."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        if _sha256(folder / name) != digest:
            raise ValueError(f"{folder / name} changed since it was prepared (sha256 mismatch); run prepare again")
    read = lambda name: [json.loads(line) for line in (folder / name).open()]  # noqa: E731
    vmap = VocabMap.from_tensors(load_file(str(folder / "vocab_map.safetensors")))
    return PreparedData(folder, read("conversations.jsonl"), read("heldout.jsonl"), vmap, manifest)
