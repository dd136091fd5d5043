"""Export, check and load a distilled draft model: a normal HF model directory that describes itself.

    ident = target_identity(target, tokenizer, "reference")
    export_draft_model(draft, tokenizer, "runs/reference-draft-model/head", ident, training={...})
    report = check_draft_model("runs/reference-draft-model/head", target, tokenizer)    # `draftsmith check`
    draft, draft_tokenizer, meta = load_draft_model("runs/reference-draft-model/head", target, tokenizer)

Layout of ``out_dir`` (written to a temp directory beside it, fsynced, then renamed into place, as
``export/writer.py`` does for EAGLE-3 heads):
    config.json, generation_config.json, model.safetensors   ``save_pretrained`` (safetensors only)
    tokenizer.json, tokenizer_config.json, chat template       ``tokenizer.save_pretrained``: the TARGET's
    draftsmith.json   ``head_type: "draft_model"``; ``head_config`` = the draft's geometry
                      (:func:`draft_head_config`); ``draft_vocab_size`` = V; ``ttt_steps`` and
                      ``aux_layer_ids`` null (a draft model reads no target hidden states); the target's
                      identity; training; eval; sha256 of every weight file
    README.md         model card (``export/card.py``)

vLLM serves the directory as ``--speculative-config '{"method": "draft_model", "model": DIR, ...}'``:
it loads it as an ordinary causal LM (config.json + safetensors) and needs the target's vocabulary,
which the export checks. draftsmith's runtime (``serve.engine``) also reads draftsmith.json and
refuses a target other than the one recorded (:func:`check_draft_model`); a plain HF draft directory
without draftsmith.json is still served, checked by its tokenizer only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.export.card import write_model_card
from draftsmith.export.check import (
    WEIGHTS_FILE,
    CheckReport,
    check_allow_mismatch,
    check_listed_weight_files,
    check_recorded_target,
)
from draftsmith.export.metadata import HeadMetadata, HeadMismatchError, read_metadata, write_metadata
from draftsmith.export.writer import staged_directory
from draftsmith.identity import config_dict, file_sha256
from draftsmith.models import load_causal_lm

logger = logging.getLogger(__name__)

__all__ = [
    "HEAD_TYPE",
    "draft_head_config",
    "export_draft_model",
    "check_draft_model",
    "load_draft_model",
    "reexport_draft_model",
]

HEAD_TYPE = "draft_model"
INDEX_FILE = "model.safetensors.index.json"  #: transformers' shard index (tensor -> file), when sharded
#: config fields recorded as the draft's geometry in draftsmith.json ``head_config``
GEOMETRY_FIELDS = (
    "model_type",
    "architectures",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
)


def draft_head_config(model) -> dict:
    """The draft LM's geometry (``GEOMETRY_FIELDS`` of its config) plus ``num_parameters``."""
    cfg = config_dict(model)
    out = {k: cfg.get(k) for k in GEOMETRY_FIELDS}
    out["architectures"] = list(out["architectures"] or [type(model).__name__])
    out["num_parameters"] = int(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))
    return out


def _vocab_rows(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def export_draft_model(
    model, tokenizer, out_dir: str | Path, target_identity: dict, training: dict | None = None, eval: dict | None = None
) -> Path:
    """Write ``model`` (a transformers causal LM) and ``tokenizer`` (the target's) to ``out_dir`` as
    described in the module docstring; returns out_dir.

    Raises:
        ValueError: the draft's vocabulary is not the recorded target's (``target_identity["vocab_size"]``).
        FileExistsError: ``out_dir`` is a non-empty directory that is not an exported head.
    """

    out_dir = Path(out_dir)
    v, want = _vocab_rows(model), target_identity.get("vocab_size")
    if want is not None and v != int(want):
        raise ValueError(
            f"export: the draft's vocabulary has {v} tokens, the target's {want}; a draft model must "
            "predict over the target's vocabulary"
        )
    with staged_directory(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        pickles = sorted(p.name for p in tmp.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        if pickles:
            raise RuntimeError(
                f"export: save_pretrained wrote pickle file(s) {pickles}; draftsmith ships safetensors only"
            )
        weights = {p.name: file_sha256(p) for p in sorted(tmp.glob("*.safetensors"))}
        if not weights:
            raise RuntimeError(f"export: save_pretrained wrote no safetensors file into {tmp}")
        meta = HeadMetadata(
            head_type=HEAD_TYPE,
            head_config=draft_head_config(model),
            draft_vocab_size=v,
            target=dict(target_identity),
            training=dict(training or {}),
            eval=dict(eval or {}),
            weights=weights,
        )
        write_metadata(tmp, meta)
        write_model_card(tmp, draft_model_card_lines, serve_dir=out_dir)
    logger.info("exported draft model to %s", out_dir)
    return out_dir


def expected_lm_tensors(model_dir: Path, where: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(tensor name -> shape, names that may be absent) of the causal LM that ``model_dir/config.json``
    builds: the model is instantiated on the meta device (no memory, no weights read), as transformers
    would before loading. The names that may be absent are tied copies (``all_tied_weights_keys``, e.g.
    ``lm_head.weight`` under ``tie_word_embeddings``), which ``save_pretrained`` leaves out.

    Raises HeadMismatchError (field ``config``) when transformers cannot build the model from the config."""

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - any failure here is a directory transformers cannot load either
        raise HeadMismatchError(
            "config",
            f"{where}: config: transformers cannot build a causal LM from config.json "
            f"({type(e).__name__}: {e}); the loader could not either. Fix: re-export.",
        ) from None
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return shapes, set(getattr(model, "all_tied_weights_keys", None) or {})


def _weight_file_tensors(model_dir: Path, rel: str) -> dict[str, tuple[int, ...]]:
    """name -> shape from a safetensors file's header (no tensor data read); HeadMismatchError if unreadable."""

    try:
        with safe_open(str(model_dir / rel), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - a file matching its hash but unparsable was exported broken
        raise HeadMismatchError(
            "weights", f"{model_dir / rel}: weights: the file cannot be read ({e}). Fix: re-export."
        ) from None


def _weight_map(model_dir: Path, meta: HeadMetadata, where: str) -> dict[str, str] | None:
    """The shard index's ``weight_map`` (tensor -> file), None for a single ``model.safetensors``; refuses an
    index naming other files than draftsmith.json lists, and several files without an index (transformers
    would read ``model.safetensors`` alone)."""

    listed = sorted(meta.weights)
    path = model_dir / INDEX_FILE
    if not path.is_file():
        if listed != [WEIGHTS_FILE]:
            raise HeadMismatchError(
                "weights",
                f"{where}: weights: draftsmith.json lists {', '.join(listed)} but there "
                f"is no {INDEX_FILE}: transformers and vLLM would not load them as one model. "
                "Fix: re-export the draft model.",
            )
        return None
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HeadMismatchError(
            "weights", f"{path}: weights: the shard index cannot be read ({e}). Fix: re-export."
        ) from None
    files = sorted(set(weight_map.values()))
    if files != listed:
        raise HeadMismatchError(
            "weights",
            f"{path}: weights: the shard index names {', '.join(files)}, "
            f"draftsmith.json lists {', '.join(listed)}. Fix: re-export the draft model.",
        )
    return weight_map


def _check_recorded_geometry(meta: HeadMetadata, config: dict, where: str) -> None:
    """draftsmith.json ``head_config`` (``GEOMETRY_FIELDS`` recorded at export) equals what config.json says,
    read as at export (``config_dict``): another geometry is another draft than the one recorded."""
    built = config_dict(config)
    differ = [
        f"{k}: draftsmith.json {v!r}, config.json {built.get(k)!r}"
        for k, v in meta.head_config.items()
        if k in GEOMETRY_FIELDS and k != "architectures" and built.get(k) != v
    ]
    if built.get("architectures") and list(built["architectures"]) != list(meta.head_config.get("architectures") or []):
        differ.append(
            f"architectures: draftsmith.json {meta.head_config.get('architectures')!r}, config.json "
            f"{built['architectures']!r}"
        )
    if differ:
        raise HeadMismatchError(
            "head_config",
            f"{where}: head_config: config.json describes another draft than "
            f"draftsmith.json records ({'; '.join(differ)}). Fix: re-export; never edit an "
            "exported config by hand.",
        )


def check_draft_weights(model_dir: Path, meta: HeadMetadata, where: str) -> None:
    """Step 3 of a draft model: every weight file's tensors against what config.json builds
    (``expected_lm_tensors``), as transformers would load them (its missing tensors are initialised at
    random with only a warning, so a file missing one is refused here): every tensor present once, in
    the file the shard index names (``model.safetensors.index.json``, when sharded), none unexpected,
    each of its shape. The files' hashes are checked before (``check_draft_model``).

    Raises HeadMismatchError (field ``weights``, or ``config``) naming the file and the tensors."""
    check_listed_weight_files(
        model_dir,
        meta,
        lambda rel: "/" not in rel and rel.endswith(".safetensors"),
        where,
        "draft model (save_pretrained)",
    )
    weight_map = _weight_map(model_dir, meta, where)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for rel in sorted(meta.weights):
        for name, shape in _weight_file_tensors(model_dir, rel).items():
            if name in found:
                raise HeadMismatchError(
                    "weights",
                    f"{model_dir / rel}: weights: {name} is also in {found[name][0]}. Fix: re-export the draft model.",
                )
            found[name] = (rel, shape)
    if weight_map is not None:
        for name in sorted(set(weight_map) | set(found)):
            mapped, held = weight_map.get(name), found.get(name, (None,))[0]
            if mapped != held:
                raise HeadMismatchError(
                    "weights",
                    f"{model_dir / INDEX_FILE}: weights: the shard index maps {name} "
                    f"to {mapped or 'no file'}, it is in {held or 'no file'}: the loader would "
                    "miss it. Fix: re-export the draft model.",
                )
    expected, tied = expected_lm_tensors(model_dir, where)
    missing = sorted(set(expected) - set(found) - tied)
    unexpected = sorted(set(found) - set(expected))
    misshapen = [
        f"{n} {found[n][1]} (config.json builds {expected[n]})"
        for n in sorted(set(found) & set(expected))
        if found[n][1] != expected[n]
    ]
    for problem, names in (
        ("missing tensor(s)", missing),
        ("unexpected tensor(s)", unexpected),
        ("misshapen tensor(s)", misshapen),
    ):
        if names:
            files = sorted({found[n.split()[0]][0] for n in names if n.split()[0] in found}) or sorted(meta.weights)
            raise HeadMismatchError(
                "weights",
                f"{where}: weights: {', '.join(files)}: {problem} "
                f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''} for the model "
                "config.json describes. Fix: re-export the draft model; config and weights "
                "disagree.",
            )


def check_draft_model(
    model_dir: str | Path,
    target_config: Any = None,
    tokenizer: Any = None,
    name_or_path: str | None = None,
    allow_mismatch=(),
) -> CheckReport:
    """Check an exported draft-model directory, and its fit to a target when one is given.

    Refuses (``HeadMismatchError`` naming the field, both values and the fix): a head_type other than
    draft_model; a weight file listed in draftsmith.json missing or with another sha256; no config.json,
    or one whose vocab_size differs from the recorded draft vocab, or whose geometry differs from the
    recorded ``head_config``; weight files whose tensors are not those config.json builds, or an unlisted
    ``*.safetensors`` (:func:`check_draft_weights`); with ``target_config`` (a model, config or dict): the
    target identity fields of ``export.check.OVERRIDABLE_FIELDS`` (overridable by
    name through ``allow_mismatch``, shared with EAGLE-3 heads: ``compare_target_identity``) and a
    target vocabulary other than the draft's (never overridable). Returns the ``CheckReport``.

    Raises ValueError for an unknown ``allow_mismatch`` field."""

    model_dir = Path(model_dir)
    where = str(model_dir)
    allow_mismatch = check_allow_mismatch(allow_mismatch)
    meta = read_metadata(model_dir)
    if meta.head_type != HEAD_TYPE:
        raise HeadMismatchError(
            "head_type",
            f"{where}: head_type is {meta.head_type!r}, not {HEAD_TYPE!r}. Fix: "
            f"serve it with method {meta.head_type!r}.",
        )
    if not meta.weights:
        raise HeadMismatchError("weights", f"{where}: weights: draftsmith.json lists no weight file. Fix: re-export.")
    for rel, want in sorted(meta.weights.items()):
        path = model_dir / rel
        if not path.is_file():
            raise HeadMismatchError(
                "weights", f"{where}: weights: file {rel} is missing. Fix: re-export or re-download the directory."
            )
        got = file_sha256(path)
        if got != want:
            raise HeadMismatchError(
                "weights",
                f"{where}: weights: sha256 of {rel} is {got}, draftsmith.json records "
                f"{want}: the file is corrupted or was modified after export. Fix: re-export "
                "or re-download the directory.",
            )
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HeadMismatchError(
            "config",
            f"{where}: config: config.json cannot be read ({e}); vLLM and "
            "transformers load the draft through it. Fix: re-export.",
        ) from e
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if text.get("vocab_size") != meta.draft_vocab_size:
        raise HeadMismatchError(
            "draft_vocab_size",
            f"{where}: draft_vocab_size: config.json has vocab_size "
            f"{text.get('vocab_size')}, draftsmith.json records {meta.draft_vocab_size}. Fix: "
            "re-export; never edit an exported config by hand.",
        )
    _check_recorded_geometry(meta, config, where)
    check_draft_weights(model_dir, meta, where)
    actual, overridden, warnings = check_recorded_target(
        meta, target_config, tokenizer, name_or_path, allow_mismatch, where, what="draft"
    )
    if actual is not None and actual.get("vocab_size") != meta.draft_vocab_size:
        raise HeadMismatchError(
            "vocab_size",
            f"{where}: vocab_size: the draft predicts over "
            f"{meta.draft_vocab_size} tokens, the target has {actual.get('vocab_size')}; a "
            "draft model needs the target's vocabulary. Fix: distil a draft for this target.",
        )
    return CheckReport(
        model_dir,
        meta,
        list(overridden),
        warnings,
        checked_target=actual is not None,
        override_values=overridden,
        allow_mismatch=allow_mismatch,
    )


def load_draft_model(
    model_dir: str | Path, target_model: Any = None, tokenizer: Any = None, allow_mismatch=(), dtype: str = "float32"
):
    """Check (as :func:`check_draft_model`) then load: returns ``(model, tokenizer, HeadMetadata)``, the
    model in eval mode with frozen parameters. The files are read again after hashing (no lock against
    a concurrent writer)."""

    report = check_draft_model(model_dir, target_model, tokenizer, None, allow_mismatch)
    model, draft_tokenizer = load_causal_lm(str(model_dir), dtype=dtype)
    return model, draft_tokenizer, report.metadata


def reexport_draft_model(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Export an exported draft model again elsewhere, verified first (weights as recorded), its metadata
    (target identity, training, eval) carried over; returns out_dir."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if model_dir.resolve() == out_dir.resolve():
        raise ValueError(f"re-export of {model_dir} onto itself; choose another --out")
    model, tokenizer, meta = load_draft_model(model_dir)
    return export_draft_model(model, tokenizer, out_dir, meta.target, training=meta.training, eval=meta.eval)


def draft_model_card_lines(head_dir: Path, meta, k: int | None) -> list[str]:
    """Front matter, serve commands and geometry of a distilled draft model (``export/draft_model.py``)."""
    target, head = meta.target, meta.head_config
    name = target.get("name_or_path")
    spec = f'{{"method": "draft_model", "model": "{head_dir}", "num_speculative_tokens": {int(k or 5)}}}'
    return [
        "---",
        "library_name: transformers",
        "tags: [speculative-decoding, draft-model, draftsmith]",
        f"base_model: {name}",
        "---",
        "",
        f"# Draft model for `{name}`",
        "",
        "A small causal LM over the target's tokenizer and vocabulary, distilled by draftsmith on the target's own "
        "answers with forward KL against the target's full next-token distribution (`train/draft_model.py`). "
        "The directory is an ordinary transformers model; `draftsmith.json` records the target's identity, the "
        "training data and the sha256 of every weight file, and draftsmith's runtime refuses another target.",
        "",
        "## Serve",
        "",
        "```bash",
        "# draftsmith (checks this draft against the target before serving)",
        f"draftsmith serve --target {name} --speculative-config '{spec}'",
        "# vLLM loads the directory as a normal causal LM",
        f"vllm serve {name} --speculative-config '{spec}'",
        "```",
        "",
        "## Draft",
        "",
        f"- target: `{name}` ({', '.join(target.get('architectures') or [])}, {target.get('num_hidden_layers')} "
        f"layers, hidden {target.get('hidden_size')}, vocab {target.get('vocab_size')})",
        f"- draft: {', '.join(head.get('architectures') or [])}, {head.get('num_hidden_layers')} layers, hidden "
        f"{head.get('hidden_size')}, {head.get('num_parameters')} parameters, vocab {head.get('vocab_size')}",
        "",
    ]
