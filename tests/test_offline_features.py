"""Offline feature cache: features equal the per-sample target forward, runs resume, and every corrupt or
mismatched cache fails loudly with the offending value."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dflash.cli import main
from hf_dflash.data.feature_cache import OfflineFeatureDataset, cache_features, target_fingerprint, writer
from hf_dflash.data.feature_cache import dataset as feature_dataset
from hf_dflash.target_features import compute_target_features
from tests.conftest import make_target
from tests.helpers.features import SAMPLES, write_tokenized

LAYER_IDS = [1, 3]
HIDDEN = 32
ALL = [sample for file in SAMPLES for sample in file]


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture
def data(tmp_path):
    return write_tokenized(tmp_path / "data")


@pytest.fixture
def cache(target, data, tmp_path):
    """A bf16 cache in 3 shards (batch 2, every batch closes a shard)."""
    return cache_features(target, data, tmp_path / "features", LAYER_IDS, batch_size=2, shard_size_bytes=1)


def open_dataset(cache, data, **overrides):
    return OfflineFeatureDataset(cache, data, **{"target_layer_ids": LAYER_IDS, "hidden_size": HIDDEN, **overrides})


@pytest.mark.parametrize(
    "dtype, atol",
    [(torch.float32, 1e-5), (torch.bfloat16, None), (torch.float16, None)],
    ids=["fp32", "bf16", "fp16"],
)
def test_cached_features_equal_single_sample_forward(target, data, tmp_path, dtype, atol):
    out = cache_features(target, data, tmp_path / "features", LAYER_IDS, dtype, batch_size=4, shard_size_bytes=600)
    index = json.loads((out / "index.json").read_text())
    assert index["complete"] and index["num_samples"] == len(ALL) and len(index["shards"]) > 1
    assert index["num_tokens"] == sum(len(sample["input_ids"]) for sample in ALL)
    assert index["feature_size"] == len(LAYER_IDS) * HIDDEN and index["dtype"] == str(dtype).removeprefix("torch.")
    assert index["target"]["fingerprint"] == target_fingerprint(target)

    dataset = open_dataset(out, data, target_fingerprint=target_fingerprint(target))
    assert dataset.sample_ids == [sample["id"] for sample in ALL]  # tokenised order, not length order
    for sample, item in zip(ALL, dataset):
        alone = compute_target_features(target, torch.tensor([sample["input_ids"]]), LAYER_IDS)[0]  # (S, n*Ht)
        assert item["target_hidden_states"].dtype == dtype
        tolerance = {} if atol is None else {"atol": atol, "rtol": 0}
        torch.testing.assert_close(item["target_hidden_states"], alone.to(dtype), **tolerance)
        assert item["input_ids"].tolist() == sample["input_ids"]
        assert item["loss_mask"].tolist() == sample["loss_mask"]


def softcapped_gemma3():
    """A tiny Gemma 3 text model whose causal-LM forward soft-caps the logits (tanh(x / 5) * 5)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, final_logit_softcapping=5.0,
    )  # fmt: skip
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3-softcapped"])
def test_the_cached_teacher_is_the_targets_own_top_k_next_token_distribution(target, data, tmp_path, arch):
    """`teacher_top_k` K: per sample, the K most likely next tokens of the model's own logits (causal-LM forward,
    soft-capping included) at every position, with their log-probabilities, beside the same features."""
    model = target if arch == "llama" else softcapped_gemma3()
    out = cache_features(model, data, tmp_path / "f", LAYER_IDS, torch.float32, batch_size=3, teacher_top_k=5)
    assert json.loads((out / "index.json").read_text())["teacher_top_k"] == 5
    dataset = open_dataset(out, data, hidden_size=model.config.hidden_size)
    assert dataset.teacher_top_k == 5
    for sample, item in zip(ALL, dataset):
        ids = torch.tensor([sample["input_ids"]])
        logprobs = model(ids).logits[0].float().log_softmax(-1)  # (S, V): row t predicts token t + 1
        top = logprobs.topk(5, dim=-1)
        assert item["teacher_ids"].dtype == torch.long and item["teacher_ids"].shape == (len(ids[0]), 5)
        torch.testing.assert_close(item["teacher_logprobs"], top.values, atol=1e-5, rtol=0)
        torch.testing.assert_close(logprobs.gather(-1, item["teacher_ids"]), top.values, atol=1e-5, rtol=0)
        alone = compute_target_features(model, ids, LAYER_IDS)[0]
        torch.testing.assert_close(item["target_hidden_states"], alone, atol=1e-5, rtol=0)


def test_a_cache_resumed_with_another_teacher_is_refused(target, data, tmp_path):
    cache_features(target, data, tmp_path / "f", LAYER_IDS, teacher_top_k=4)
    with pytest.raises(ValueError, match="teacher_top_k=4, this run asks for 8"):
        cache_features(target, data, tmp_path / "f", LAYER_IDS, teacher_top_k=8)
    with pytest.raises(ValueError, match="teacher_top_k=4, this run asks for 0"):
        cache_features(target, data, tmp_path / "f", LAYER_IDS)
    with pytest.raises(ValueError, match="teacher_top_k must be a count"):
        cache_features(target, data, tmp_path / "g", LAYER_IDS, teacher_top_k=-1)
    index = json.loads((tmp_path / "f" / "index.json").read_text())
    (tmp_path / "f" / "index.json").write_text(json.dumps({**index, "teacher_top_k": 7}))  # not what the shards hold
    with pytest.raises(ValueError, match=r"expected I32 \[\d+, 7\] \('a.teacher_ids'\), found I32 \[\d+, 4\]"):
        open_dataset(tmp_path / "f", data)


def test_top_k_teacher_keeps_the_k_and_spreads_the_rest_evenly():
    from hf_dflash.trainer.maths import target_to_draft_index, top_k_teacher_logits

    logprobs = torch.randn(3, 10).log_softmax(-1)
    top = logprobs.topk(4, dim=-1)
    dense = top_k_teacher_logits(top.indices, top.values, 10)
    torch.testing.assert_close(dense.exp().sum(-1), torch.ones(3))
    torch.testing.assert_close(dense.gather(-1, top.indices), top.values)
    others = torch.ones(3, 10, dtype=torch.bool).scatter(1, top.indices, False)
    rest = (1 - top.values.exp().sum(-1, keepdim=True)) / 6
    torch.testing.assert_close(dense[others].view(3, 6), rest.log().expand(3, 6))
    torch.testing.assert_close(top_k_teacher_logits(*logprobs.topk(10, dim=-1)[::-1], 10), logprobs)  # K = V: exact
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 5, 8]] = True
    in_draft = top_k_teacher_logits(top.indices, top.values, 10, target_to_draft_index(t2d))
    torch.testing.assert_close(in_draft, dense[:, [1, 4, 5, 8]])  # the same values over the draft ids, in id order


@pytest.mark.parametrize("crash", ["before_write", "after_rename", "torn_log"])
def test_interrupted_run_resumes_to_the_same_cache(target, data, tmp_path, monkeypatch, crash):
    reference = cache_features(target, data, tmp_path / "reference", LAYER_IDS, batch_size=2, shard_size_bytes=1)

    real_write = writer._write_shard
    writes = []

    def dies_on_second_shard(tensors, path):
        writes.append(path.name)
        if len(writes) == 2 and crash != "after_rename":
            raise RuntimeError("killed")
        entry = real_write(tensors, path)
        if len(writes) == 2:  # renamed into place but never recorded: a restart must redo it
            raise RuntimeError("killed")
        return entry

    monkeypatch.setattr(writer, "_write_shard", dies_on_second_shard)
    resumed = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="killed"):
        cache_features(target, data, resumed, LAYER_IDS, batch_size=2, shard_size_bytes=1)
    if crash == "torn_log":  # died while appending the second shard's record
        with open(resumed / "progress.jsonl", "a") as handle:
            handle.write('{"shard": "features-00001.safetensors", "entry": {"by')
        assert len(writer.recover_progress(resumed)["shards"]) == 1
        assert (resumed / "progress.jsonl").read_text().count("\n") == 1  # the torn tail is cut off
    with pytest.raises(ValueError, match="unfinished"):
        open_dataset(resumed, data)

    monkeypatch.setattr(writer, "_write_shard", real_write)
    computed = []
    real_batch_features = writer.batch_features
    monkeypatch.setattr(
        writer,
        "batch_features",
        lambda target, tokens, *args: computed.extend(tokens) or real_batch_features(target, tokens, *args),
    )
    cache_features(target, data, resumed, LAYER_IDS, batch_size=2, shard_size_bytes=1)

    assert len(computed) == len(ALL) - 2  # the first shard (one batch of 2) was not recomputed
    assert json.loads((resumed / "index.json").read_text()) == json.loads((reference / "index.json").read_text())
    assert not (resumed / "progress.jsonl").exists()
    assert sorted(path.name for path in resumed.iterdir()) == sorted(path.name for path in reference.iterdir())
    for shard in reference.glob("features-*.safetensors"):
        expected, got = load_file(shard), load_file(resumed / shard.name)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[key], got[key]) for key in expected)


def test_rerun_on_a_finished_cache_computes_nothing(target, data, cache, monkeypatch):
    before = (cache / "index.json").read_text()
    monkeypatch.setattr(writer, "batch_features", lambda *args: pytest.fail("recomputed a cached sample"))
    cache_features(target, data, cache, LAYER_IDS, batch_size=2, shard_size_bytes=1)
    assert (cache / "index.json").read_text() == before


def test_resuming_with_other_layer_ids_refuses(target, data, cache):
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 3\], this run asks for \[1, 2\]"):
        cache_features(target, data, cache, [1, 2])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"target_layer_ids": [1, 4]}, r"target_layer_ids=\[1, 3\].*\[1, 4\].*--target-layer-ids 1,4"),
        ({"hidden_size": 64}, r"hidden_size=32.*target_hidden_size=64"),
        ({"target_fingerprint": "other_target"}, r"embedding_sha256="),
        ({"verify": "sha"}, r"verify='sha'"),
    ],
    ids=["layer_ids", "hidden_size", "other_target", "verify_option"],
)
def test_mismatched_expectations_raise(cache, data, overrides, message):
    if overrides.get("target_fingerprint") == "other_target":
        overrides = {"target_fingerprint": target_fingerprint(make_target("llama", seed=1))}
    with pytest.raises(ValueError, match=message):
        open_dataset(cache, data, **overrides)


def first_shard(cache: Path) -> Path:
    return cache / "features-00000.safetensors"


def truncate(cache, data):
    first_shard(cache).write_bytes(first_shard(cache).read_bytes()[:-10])


def flip_last_byte(cache, data):
    raw = bytearray(first_shard(cache).read_bytes())
    raw[-1] ^= 0xFF
    first_shard(cache).write_bytes(bytes(raw))


def garble_header(cache, data):
    raw = bytearray(first_shard(cache).read_bytes())
    raw[8:12] = b"\xff\xfe{["
    first_shard(cache).write_bytes(bytes(raw))


def edit_index_length(cache, data):
    index = json.loads((cache / "index.json").read_text())
    index["samples"]["a"]["length"] = 4
    (cache / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "damage, verify, message",
    [
        (truncate, "size", r"features-00000.safetensors is \d+ bytes, index.json says \d+"),
        (flip_last_byte, "full", r"features-00000.safetensors has sha256 [0-9a-f]{64}, index.json says"),
        (garble_header, "size", r"features-00000.safetensors is corrupt: its safetensors header is unreadable"),
        (edit_index_length, "size", r"Sample 'a' in feature shard .*: expected BF16 \[4, 64\], found BF16 \[3, 64\]"),
    ],
    ids=["truncated", "sha256", "header", "index_length"],
)
def test_corrupt_cache_raises_naming_the_shard(cache, data, damage, verify, message):
    damage(cache, data)
    with pytest.raises(ValueError, match=message):
        open_dataset(cache, data, verify=verify)


def test_sha256_is_only_checked_with_verify_full(cache, data):
    flip_last_byte(cache, data)  # same size, readable header: only the hash can tell
    assert len(open_dataset(cache, data)) == len(ALL)


def test_truncated_tensor_data_is_caught_from_the_header(cache, data):
    shard = first_shard(cache)
    shard.write_bytes(shard.read_bytes()[:-10])
    index = json.loads((cache / "index.json").read_text())
    index["shards"][shard.name]["bytes"] = shard.stat().st_size  # a writer that recorded the truncated size
    (cache / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"features-00000.safetensors is truncated: tensor '\w+' ends at byte"):
        open_dataset(cache, data)


def test_token_length_differing_from_features_raises_naming_the_sample(cache, data):
    path = data / "tokenized-00000.jsonl"
    text = path.read_text()
    # Same byte size (so the file-size check passes), one more token: "[5, 17, 9]" -> "[5,17,9,4]".
    edited = text.replace('[5, 17, 9], "loss_mask": [0, 1, 1]', '[5,17,9,4], "loss_mask": [0,1,1,1]')
    assert edited != text and len(edited) == len(text)
    path.write_text(edited)
    dataset = open_dataset(cache, data)
    with pytest.raises(ValueError, match=r"Sample 'a': .* 4 tokens where shard features-\d+.safetensors has 3"):
        dataset[0]


def test_changed_tokenized_file_raises(cache, data):
    with open(data / "tokenized-00001.jsonl", "a") as handle:
        handle.write(json.dumps({"id": "g", "input_ids": [1, 2], "loss_mask": [1, 1]}) + "\n")
    with pytest.raises(ValueError, match=r"tokenized-00001.jsonl is \d+ bytes.*cached from \d+ bytes"):
        open_dataset(cache, data)


def test_dataset_opens_shards_lazily_once_per_process(cache, data, monkeypatch):
    opened = []
    real_safe_open = feature_dataset.safe_open

    def counting_safe_open(path, **kwargs):
        opened.append(path)
        return real_safe_open(path, **kwargs)

    monkeypatch.setattr(feature_dataset, "safe_open", counting_safe_open)
    dataset = open_dataset(cache, data)
    assert opened == [] and dataset._handles == {}  # the constructor read headers only, no tensor
    index = dataset.index["samples"]
    shard_of_a = index["a"]["shard"]
    same_shard = [i for i, sample_id in enumerate(dataset.sample_ids) if index[sample_id]["shard"] == shard_of_a]
    assert len(same_shard) == 2
    for item in same_shard:
        assert dataset[item]["target_hidden_states"].shape == (len(ALL[item]["input_ids"]), 2 * HIDDEN)
    assert len(opened) == 1  # both samples came from one mapping of their shard
    copy = pickle.loads(pickle.dumps(dataset))  # what a DataLoader worker receives: no open handles
    assert copy._handles == {}
    torch.testing.assert_close(copy[same_shard[0]], dataset[same_shard[0]])


def test_cli_cache_features(target, data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("hf_dflash.targets.load_target", lambda name, dtype: (target, None))
    out = tmp_path / "cli"
    args = ["cache-features", "--data", str(data), "--out", str(out), "--target", "tiny"]
    assert main([*args, "--target-layer-ids", "1,3", "--dtype", "float16", "--batch-size", "3"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["target"]["name"] == "tiny" and index["target_layer_ids"] == [1, 3] and index["dtype"] == "float16"
    assert main([*args, "--target-layer-ids", "1,3", "--teacher-top-k", "6", "--out", str(tmp_path / "t")]) == 0
    assert json.loads((tmp_path / "t" / "index.json").read_text())["teacher_top_k"] == 6
    assert "and its top-6 next tokens" in capsys.readouterr().out
    assert main([*args, "--target-layer-ids", "1,9"]) == 2
    assert "target_layer_ids=[1, 9]" in capsys.readouterr().err


@pytest.mark.real_model
def test_smollm2_bf16_cache_size_per_token(real_target, tmp_path):
    """bf16, 5 layers x hidden 576: 5760 bytes per token plus a small per-sample header and index entry."""
    model, tokenizer = real_target
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n" * 2, "Hello! " * 10]
    data = tmp_path / "data"
    data.mkdir()
    lines = []
    for number, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"]
        lines.append(json.dumps({"id": f"s{number}", "input_ids": ids, "loss_mask": [1] * len(ids)}))
    (data / "tokenized-00000.jsonl").write_text("\n".join(lines) + "\n")
    out = cache_features(model, data, tmp_path / "features", [1, 8, 14, 20, 27], target_name="smollm2-135m-instruct")
    index = json.loads((out / "index.json").read_text())
    shard_bytes = sum(entry["bytes"] for entry in index["shards"].values())
    assert index["num_tokens"] * 5 * 576 * 2 < shard_bytes < index["num_tokens"] * 5 * 576 * 2 + 200 * len(texts)
    dataset = OfflineFeatureDataset(out, data, target_layer_ids=[1, 8, 14, 20, 27], hidden_size=576)
    assert dataset[0]["target_hidden_states"].shape == (index["samples"]["s0"]["length"], 2880)
