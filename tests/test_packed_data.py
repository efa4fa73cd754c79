"""Packed training data (token ids + loss masks in safetensors shards with a manifest)."""

import json

import pytest

from hf_dflash.data.packed import MANIFEST_NAME, PackedDataset, pack_tokenized, read_manifest
from tests.helpers.data import SETTINGS, make_char_tokenizer, sample, write_tokenized


def test_round_trip_incremental_and_counted(tmp_path):
    tok = make_char_tokenizer()
    tokenized = tmp_path / "tok"
    write_tokenized(tokenized, "tokenized-00000.jsonl", [sample(i) for i in range(3)])
    write_tokenized(tokenized, "tokenized-00001.jsonl", [sample(i, "math") for i in range(2)])
    out = tmp_path / "packed"
    manifest = pack_tokenized(tokenized, out, part="p1", settings=SETTINGS, tokenizer=tok, samples_per_shard=3)
    assert [s["tokenized"] for s in manifest["shards"]] == [["tokenized-00000.jsonl"], ["tokenized-00001.jsonl"]]
    assert manifest["totals"] == {
        "samples": 5,
        "tokens": 20,
        "supervised_tokens": 15,
        "per_source": {"gsm8k": 3, "math": 2},
    }
    # a later run packs only what is new
    write_tokenized(tokenized, "tokenized-00002.jsonl", [sample(i, "codeio") for i in range(1)])
    manifest = pack_tokenized(tokenized, out, part="p1", settings=SETTINGS, tokenizer=tok, samples_per_shard=3)
    assert len(manifest["shards"]) == 3 and manifest["totals"]["samples"] == 6
    dataset = PackedDataset(out, vocab_size=len(tok))
    assert [item["id"] for item in dataset] == [f"gsm8k:{i}" for i in range(3)] + ["math:0", "math:1", "codeio:0"]
    assert dataset[1] == sample(1)
    assert read_manifest(out)["parts"] == {"p1": {"settings": SETTINGS}}


def test_refusals_name_the_problem(tmp_path):
    tok = make_char_tokenizer()
    tokenized = tmp_path / "tok"
    write_tokenized(tokenized, "tokenized-00000.jsonl", [sample(0)])
    out = tmp_path / "packed"
    pack_tokenized(tokenized, out, part="p1", settings=SETTINGS, tokenizer=tok)
    with pytest.raises(ValueError, match="other settings"):
        pack_tokenized(tokenized, out, part="p1", settings={**SETTINGS, "dtype": "float32"}, tokenizer=tok)
    with pytest.raises(ValueError, match="packed already"):
        pack_tokenized(tokenized, out, part="p2", settings=SETTINGS, tokenizer=tok)
    shard = out / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="shard-00000.safetensors does not match its sha256"):
        PackedDataset(out)
    with pytest.raises(ValueError, match="no part"):
        PackedDataset(out, parts=["nope"])
    (out / MANIFEST_NAME).write_text("{")
    with pytest.raises(ValueError, match="corrupt JSON"):
        PackedDataset(out)


def test_training_reads_a_packed_folder_with_a_sample_limit(tmp_path, run_config):  # noqa: F811

    from hf_dflash.trainer.train import load_train_config, train_from_config
    from tests.helpers.training import samples

    tokenized = tmp_path / "tok"
    rows = [{"id": f"{'gsm8k' if i % 2 else 'math'}:{i}", **row} for i, row in enumerate(samples(count=8))]
    write_tokenized(tokenized, "tokenized-00000.jsonl", rows)
    pack_tokenized(tokenized, tmp_path / "packed", part="p1", settings=SETTINGS, tokenizer=make_char_tokenizer())
    config = load_train_config(run_config)
    config["data"] = {"tokenized": str(tmp_path / "packed"), "eval_samples": 2, "max_train_samples": 4}
    config["training"].update(max_steps=1, eval_strategy="no", save_strategy="no")
    trainer = train_from_config(config)
    record = json.loads((tmp_path / "drafter" / "training_record.json").read_text())
    assert record["num_samples"] == 4 and record["data_sources"] == {"gsm8k": 2, "math": 2}
    assert len(trainer.train_dataset) == 4


def test_pack_data_command_records_the_run_settings(tmp_path, monkeypatch, capsys):
    from hf_dflash import cli

    tok = make_char_tokenizer()
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: tok)
    monkeypatch.setattr("hf_dflash.targets.default_cache_dir", lambda: tmp_path)  # a "converted" target folder
    (tmp_path / "smollm2-135m-instruct").mkdir()
    tokenized, responses = tmp_path / "tok", tmp_path / "responses"
    write_tokenized(tokenized, "tokenized-00000.jsonl", [sample(0), sample(1, "math")])
    responses.mkdir()
    (responses / "config.json").write_text(json.dumps({"dtype": "torch.bfloat16", "max_new_tokens": 384}))
    (tokenized / "config.json").write_text(json.dumps({"max_length": 1024}))
    argv = [
        "pack-data",
        "--tokenized",
        str(tokenized),
        "--out",
        str(tmp_path / "packed"),
        "--part",
        "p1",
        "--responses",
        str(responses),
        "--note",
        "a test",
    ]
    assert cli.main(argv) == 0
    assert "2 samples" in capsys.readouterr().out
    settings = read_manifest(tmp_path / "packed")["parts"]["p1"]["settings"]
    assert settings == {
        "regeneration": {"dtype": "torch.bfloat16", "max_new_tokens": 384},
        "tokenization": {"max_length": 1024},
        "note": "a test",
    }
    assert cli.main([*argv[:-4], "--responses", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_held_out_part_stays_the_same_when_data_is_added(tmp_path):
    from types import SimpleNamespace

    from hf_dflash.trainer.train import build_datasets

    tok, out = make_char_tokenizer(), tmp_path / "packed"
    online = SimpleNamespace(feature_mode="online")

    def add_part(name, source, count):
        write_tokenized(tmp_path / name, "tokenized-00000.jsonl", [sample(i, source) for i in range(count)])
        pack_tokenized(tmp_path / name, out, part=name, settings=SETTINGS, tokenizer=tok)

    def split(**section):
        train, evaluation = build_datasets({"tokenized": str(out), **section}, online, None, len(tok))
        return [item["id"] for item in train], [item["id"] for item in evaluation]

    add_part("p1", "math", 3)
    add_part("p2", "gsm8k", 4)
    train, held_out = split(eval_samples=2, eval_part="p2")
    assert held_out == ["gsm8k:0", "gsm8k:1"]
    assert train == ["math:0", "math:1", "math:2", "gsm8k:2", "gsm8k:3"]
    add_part("p3", "codeio", 2)
    train, held_out_later = split(eval_samples=2, eval_part="p2", max_train_samples=6)
    assert held_out_later == held_out and train == ["math:0", "math:1", "math:2", "gsm8k:2", "gsm8k:3", "codeio:0"]
    assert split(eval_samples=1)[1] == ["codeio:1"]  # without eval_part: the last samples, which move
    with pytest.raises(ValueError, match="eval_part='p9'.*has p1, p2, p3"):
        split(eval_samples=2, eval_part="p9")
    with pytest.raises(ValueError, match="eval_samples=5.*p2 has 4"):
        split(eval_samples=5, eval_part="p2")
    with pytest.raises(ValueError, match="eval_part='p2' is not among data.parts"):
        split(eval_samples=2, eval_part="p2", parts=["p1", "p3"])
    write_tokenized(tmp_path / "plain", "tokenized-00000.jsonl", [sample(0)])
    with pytest.raises(ValueError, match="eval_part needs a packed folder"):
        build_datasets({"tokenized": str(tmp_path / "plain"), "eval_part": "p1"}, online, None, len(tok))

    from hf_dflash.trainer.heldout import held_out_samples

    # the scoring scripts' held-out chats: a part's first, or the last of the parts kept (a set that was the
    # data's last before more was appended)
    assert [s["id"] for s in held_out_samples(out, 2, eval_part="p2")] == ["gsm8k:0", "gsm8k:1"]
    assert [s["id"] for s in held_out_samples(out, 2)] == ["codeio:0", "codeio:1"]
    assert [s["id"] for s in held_out_samples(out, 2, parts=["p1", "p2"])] == ["gsm8k:2", "gsm8k:3"]
    with pytest.raises(ValueError, match="is not among data.parts"):
        held_out_samples(out, 2, eval_part="p2", parts=["p1"])


def folder_files(folder):
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"input_ids": [1, 70000, 2, 3]}, "input_ids[1] = 70000 is outside the tokenizer's vocabulary"),
        ({"input_ids": [1, 5000, 2, 3]}, "input_ids[1] = 5000 is outside"),
        ({"input_ids": [1, -1, 2, 3]}, "input_ids[1] = -1 is outside"),
        ({"input_ids": [1, True, 2, 3]}, "input_ids[1]: expected an integer, got True"),
        ({"input_ids": [1, 2.5, 2, 3]}, "input_ids[1]: expected an integer, got 2.5"),
        ({"loss_mask": [0, 1, 1]}, "loss_mask has 3 values for 4 input_ids"),
        ({"loss_mask": [0, 1, -1, 1]}, "loss_mask[2] = -1: mask values are 0 or 1"),
        ({"loss_mask": [0, 1, 2, 1]}, "loss_mask[2] = 2"),
        ({"loss_mask": None}, "field loss_mask: expected a non-empty list"),
        ({"input_ids": "abcd"}, "field input_ids: expected a non-empty list"),
        ({"id": ""}, "field id: expected a non-empty string"),
    ],
)
def test_every_sample_is_checked_before_anything_is_written(tmp_path, bad, fragment):
    """Issue 25 B3: an id that the uint16 cast would wrap (70000 -> 4464), an id past the vocabulary, a mask
    shorter than the ids (it shifted the next samples' masks) or outside 0/1 (-1 became 255) is refused,
    naming file, line, sample and field; a good file before the bad one is not packed either."""
    tok = make_char_tokenizer()
    tokenized = tmp_path / "tok"
    write_tokenized(tokenized, "tokenized-00000.jsonl", [sample(i) for i in range(3)])
    write_tokenized(tokenized, "tokenized-00001.jsonl", [sample(10), {**sample(11), **bad}])
    out = tmp_path / "packed"
    with pytest.raises(ValueError) as caught:
        pack_tokenized(tokenized, out, part="p1", settings=SETTINGS, tokenizer=tok, samples_per_shard=2)
    message = str(caught.value)
    assert "tokenized-00001.jsonl:2" in message and fragment in message, message
    assert bad.get("id") == "" or "sample 'gsm8k:11'" in message
    assert folder_files(out) == []


def test_a_sample_without_a_field_is_named(tmp_path):
    tok = make_char_tokenizer()
    write_tokenized(tmp_path / "tok", "tokenized-00000.jsonl", [{"id": "math:0", "input_ids": [1, 2]}])
    with pytest.raises(ValueError, match=r"tokenized-00000.jsonl:1 sample 'math:0': missing field\(s\) loss_mask"):
        pack_tokenized(tmp_path / "tok", tmp_path / "packed", part="p1", settings=SETTINGS, tokenizer=tok)


def test_a_second_writer_is_refused_and_changes_nothing(tmp_path):
    """Issue 25 B1: while one pack-data run writes a folder, another one is refused at once (before, both
    exited 0: the manifest listed one part and the shards held the other's bytes)."""
    from hf_dflash.folder_lock import FolderLockedError, folder_lock

    tok = make_char_tokenizer()
    write_tokenized(tmp_path / "a", "tokenized-00000.jsonl", [sample(i) for i in range(2)])
    write_tokenized(tmp_path / "b", "tokenized-00000.jsonl", [sample(i, "math") for i in range(2)])
    out = tmp_path / "packed"
    pack_tokenized(tmp_path / "a", out, part="a", settings=SETTINGS, tokenizer=tok)
    before = {name: (out / name).read_bytes() for name in folder_files(out)}
    with folder_lock(out, "pack-data"):  # the first writer, still at work
        with pytest.raises(FolderLockedError, match=r"another process is writing to .*packed \(lock file"):
            pack_tokenized(tmp_path / "b", out, part="b", settings=SETTINGS, tokenizer=tok)
    assert {name: (out / name).read_bytes() for name in folder_files(out)} == before
    manifest = pack_tokenized(tmp_path / "b", out, part="b", settings=SETTINGS, tokenizer=tok)  # once it is done
    assert sorted(manifest["parts"]) == ["a", "b"] and folder_files(out) == [
        MANIFEST_NAME,
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert [item["id"] for item in PackedDataset(out)] == ["gsm8k:0", "gsm8k:1", "math:0", "math:1"]


def test_appending_checks_the_existing_shards_first(tmp_path):
    tok = make_char_tokenizer()
    write_tokenized(tmp_path / "a", "tokenized-00000.jsonl", [sample(0)])
    write_tokenized(tmp_path / "b", "tokenized-00000.jsonl", [sample(0, "math")])
    out = tmp_path / "packed"
    pack_tokenized(tmp_path / "a", out, part="a", settings=SETTINGS, tokenizer=tok)
    shard = out / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="shard-00000.safetensors does not match its sha256"):
        pack_tokenized(tmp_path / "b", out, part="b", settings=SETTINGS, tokenizer=tok)
    assert folder_files(out) == [MANIFEST_NAME, "shard-00000.safetensors"]


def test_a_corrupt_manifest_and_an_empty_part_name_are_named(tmp_path):
    tok = make_char_tokenizer()
    write_tokenized(tmp_path / "a", "tokenized-00000.jsonl", [sample(0)])
    out = tmp_path / "packed"
    with pytest.raises(ValueError, match="part '': name the regeneration run"):
        pack_tokenized(tmp_path / "a", out, part="", settings=SETTINGS, tokenizer=tok)
    pack_tokenized(tmp_path / "a", out, part="a", settings=SETTINGS, tokenizer=tok)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    del manifest["shards"][0]["sha256"]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json is corrupt: shard entry 0 lacks \['sha256'\]"):
        read_manifest(out)
    (out / MANIFEST_NAME).write_text(json.dumps({"format": "hf-dflash-packed-v1"}))
    with pytest.raises(ValueError, match="'tokenizer' must be a JSON object"):
        pack_tokenized(tmp_path / "a", out, part="a", settings=SETTINGS, tokenizer=tok)


def test_pack_data_command_names_bad_arguments_before_loading_anything(tmp_path, capsys):
    from hf_dflash import cli

    write_tokenized(tmp_path / "tok", "tokenized-00000.jsonl", [sample(0)])
    (tmp_path / "file").write_text("x")
    argv = ["pack-data", "--tokenized", str(tmp_path / "tok"), "--target", "nope"]
    for extra, fragment in [
        (["--out", str(tmp_path / "p"), "--part", ""], "part '': name the regeneration run"),
        (["--out", str(tmp_path / "file"), "--part", "p1"], "is a file, not a folder"),
        (["--out", str(tmp_path / "p"), "--part", "p1", "--samples-per-shard", "0"], "--samples-per-shard"),
    ]:
        assert cli.main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert "hf-dflash pack-data: error:" in err and fragment in err, err
