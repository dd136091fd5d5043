"""Writes tests/data/legacy-v0.1: runs of the three trainable drafters as draftsmith 0.1 (commit 932277f,
the root-as-package layout) wrote them: a tiny target saved as a folder, prepared data, a checkpoint,
and the exported head. Run from a checkout of that commit:
    PYTHONPATH=<dir holding draftsmith -> checkout> python make_legacy.py OUT
"""
import json, random, shutil, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(sys.argv[2])))           # the old tests/ (conftest builders)
from conftest import make_tiny_llama, make_chatml_tokenizer
from draftsmith.config import load_config
from draftsmith.pipeline import Recipe, run_train

out = Path(sys.argv[1]).resolve()
shutil.rmtree(out, ignore_errors=True); out.mkdir(parents=True)
tok = make_chatml_tokenizer()
target = make_tiny_llama(seed=3, vocab_size=len(tok))
target.save_pretrained(out / "target"); tok.save_pretrained(out / "target")
rng = random.Random(0)
words = ["def", "add", "(a, b)", "return", "a + b", "Hello", "there", "how", "are", "you", "?", ":"]
convs = [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 6)))},
                       {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(4, 12)))}]}
         for _ in range(14)]
(out / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
import os
os.chdir(out)
common = ["out_dir=runs", "data.source=conversations.jsonl", "data.num_conversations=11",
          "data.heldout_conversations=3", "data.regenerate=false", "data.max_length=48", "data.draft_vocab_size=128",
          "target.name_or_path=target", "train.max_steps=2", "train.batch_size=4", "train.warmup_steps=1",
          "train.log_every=1", "train.mixed_precision='no'", "eval.k=3", "eval.methods=[eagle3, ngram]",
          "eval.prompts_per_task=2", "export.formats=[draftsmith, speculators]"]
runs = {"eagle3": ["name=eagle3", "method=eagle3", "head.aux_layer_ids=[1, 2, 3]", "head.ttt_steps=3"],
        "draft_model": ["name=draft_model", "method=draft_model", "draft_model.init_from=null",
                        "draft_model.num_hidden_layers=1", "export.formats=[draftsmith]"],
        "mlp_speculator": ["name=mlp_speculator", "method=mlp_speculator", "mlp_speculator.n_predict=3",
                           "export.formats=[draftsmith]"]}
for name, extra in runs.items():
    recipe = load_config(Recipe, None, common + extra)
    head = run_train(recipe, target, tok)
    print(name, head)
