"""``vllm-kvcomp calibrate`` end to end on a tiny random Llama folder with a word-level tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_kvcomp.calibration import layer_groups
from vllm_kvcomp.calibration.profiles import load_profile
from vllm_kvcomp.cli import main


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    words = sorted({w for s in range(20) for w in layer_groups.pseudo_text(300, s).replace(".", " .").replace(",", " ,").split()})
    vocab = {tok: i for i, tok in enumerate(["<s>", "</s>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_calibrate_all_writes_loadable_profiles(tiny_model_dir, capsys):
    code = main([
        "calibrate", "--model", str(tiny_model_dir), "--kind", "all", "--quiet", "--length", "12",
        "--repeats", "3", "--samples", "2", "--pod-samples", "2", "--pod-words", "40", "--pod-last", "4",
        "--threads", "1", *DUO_SMALL, *KVZAP_SMALL,
    ])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    razor = load_profile("razor", model_dir=tiny_model_dir)
    pod = load_profile("pod", model_dir=tiny_model_dir)
    assert summary["razor"]["count"] == f"{len(razor.kv_heads)}/6"
    # 12 query heads: ceil(14%) = 2 induction + ceil(1%) = 1 echo -> 1..3 query heads, 1..3 KV heads
    assert len(razor.induction_heads) == 2 and len(razor.echo_heads) == 1 and 1 <= len(razor.kv_heads) <= 3
    assert razor.settings["prefix"] == [0] and razor.settings["length"] == 12
    assert [list(g) for g in pod.groups] == summary["pod"]["groups"]
    assert sorted(x for g in pod.groups for x in g) == [0, 1, 2]
    duo = load_profile("duoattention", model_dir=tiny_model_dir)
    assert len(duo.gates) == 3 and summary["duoattention"]["path"].endswith("duoattention.json")
    scorer = load_profile("kvzap", model_dir=tiny_model_dir)
    assert len(scorer.weights) == 3 and summary["kvzap"]["r2"] == scorer.settings["r2"]
    assert scorer.settings["samples"] == 3 and summary["kvzap"]["train_tokens"] == scorer.settings["train_tokens"] > 0


#: small KVzap settings: three short texts, one held out
KVZAP_SMALL = ("--kvzap-samples", "3", "--kvzap-holdout", "1", "--kvzap-words", "30", "--kvzap-needles", "1")
#: small DuoAttention settings: a few steps on short samples (seconds)
DUO_SMALL = ("--duo-steps", "3", "--duo-min-length", "16", "--duo-max-length", "32", "--duo-sink", "2",
             "--duo-recent", "4", "--duo-passkeys", "2", "--duo-passkey-words", "2")


def test_calibrate_duoattention_trains_the_gates_of_every_kv_head(tiny_model_dir, tmp_path, capsys):
    code = main(["calibrate", "--model", str(tiny_model_dir), "--kind", "duoattention", "--quiet", "--threads", "1",
                 "--name", "short", "--out", str(tmp_path), "--seed", "2", *DUO_SMALL])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == {"model", "duoattention"}
    profile = load_profile("duoattention", path=tmp_path / "duoattention.short.json")
    assert [len(row) for row in profile.gates] == [2, 2, 2] and profile.name == "short"
    assert profile.settings["steps"] == 3 and profile.settings["seed"] == 2 and profile.settings["prefix"] == [0]
    retrieval = sum(g >= profile.threshold for row in profile.gates for g in row)
    assert summary["duoattention"]["retrieval_heads"] == f"{retrieval}/6"


def test_calibrate_named_profile_into_out_dir(tiny_model_dir, tmp_path, capsys):
    code = main([
        "calibrate", "--model", str(tiny_model_dir), "--kind", "pod", "--quiet", "--name", "short",
        "--pod-samples", "1", "--pod-words", "30", "--pod-last", "4", "--delta", "0.0", "--out", str(tmp_path),
    ])
    assert code == 0
    assert "razor" not in json.loads(capsys.readouterr().out)
    profile = load_profile("pod", path=tmp_path / "pod.short.json")
    assert profile.groups == ((0, 1, 2),) and profile.name == "short"  # delta 0 merges everything


def test_calibrate_rejects_bad_name(tiny_model_dir):
    with pytest.raises(SystemExit, match="--name"):
        main(["calibrate", "--model", str(tiny_model_dir), "--name", "No Good"])
