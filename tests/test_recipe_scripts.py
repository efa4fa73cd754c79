"""The variant grammar (hf_dflash.trainer.variants) shared by scripts/train_on_gpu.py and
benchmarks/training/recipe_comparison.py, and the training dtype rule of the CPU path (the runs
themselves are measured, not unit-tested)."""

import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_dflash import dtypes
from hf_dflash.trainer.variants import parse_variant, starting_drafter, with_base

ROOT = Path(__file__).resolve().parents[1]


def load_module(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a benchmark importing its sibling (learning_curve: recipe_comparison) finds it
    spec.loader.exec_module(module)
    return module


train_on_gpu = load_module("scripts/train_on_gpu.py")
recipe = load_module("benchmarks/training/recipe_comparison.py")


def test_parse_variant_sections_and_json_values():
    name, sections = parse_variant(
        'L2:num_hidden_layers=2,draft_vocab_size=null,training.loss_type=kl,training.eval_strategy="no",'
        "data.max_train_samples=250,init_from_target=true"
    )
    assert name == "L2"
    assert sections == {
        "drafter": {"num_hidden_layers": 2, "draft_vocab_size": None, "init_from_target": True},
        "training": {"loss_type": "kl", "eval_strategy": "no"},
        "data": {"max_train_samples": 250},
    }
    with pytest.raises(ValueError, match="lora.r"):
        parse_variant("X:lora.r=8")


def test_base_comes_first_so_a_variant_overrides_it():
    spec = with_base("L1:num_hidden_layers=1", "num_hidden_layers=2,training.seed=3")
    _, sections = parse_variant(spec)
    assert sections["drafter"] == {"num_hidden_layers": 1}
    assert sections["training"] == {"seed": 3}
    assert with_base("L2:", "num_hidden_layers=2") == "L2:num_hidden_layers=2"


def test_warm_start_keeps_its_architecture_and_names_its_start():
    spec = with_base(
        "v1:init_from=models/x,training.learning_rate=2e-4",
        'num_hidden_layers=2,draft_vocab_size=8192,training.eval_strategy="no"',
    )
    _, sections = parse_variant(spec)
    assert sections["drafter"] == {"init_from": "models/x"}  # no architecture keys next to init_from
    assert sections["training"] == {"eval_strategy": "no", "learning_rate": 2e-4}
    assert starting_drafter(spec) == "models/x"
    assert starting_drafter("L2:num_hidden_layers=2") is None


def test_every_built_in_variant_parses_with_a_unique_name():
    names = [parse_variant(with_base(spec, recipe.BASE))[0] for spec in recipe.VARIANTS]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(
    "flags, device, expected",
    [({"avx512_bf16", "amx_bf16"}, "cpu", True), ({"avx2", "avx512f"}, "cpu", False), ({"avx2"}, "cuda", True)],
)
def test_training_autocasts_bf16_only_where_it_is_native(monkeypatch, flags, device, expected):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
    assert train_on_gpu.train_in_bf16(device) is expected


curve = load_module("benchmarks/training/learning_curve.py")


def test_learning_curve_runs_share_steps_and_evaluation_points():
    specs = [with_base(spec, curve.BASE) for spec in curve.run_specs(2400, 300, [2400, 5000], 64)]
    parsed = [parse_variant(spec) for spec in specs]
    assert [name for name, _ in parsed] == ["all-chats", "2400-chats", "5000-chats"]
    for _, sections in parsed:
        assert sections["training"]["max_steps"] == 2400 and sections["training"]["eval_steps"] == 300
        assert sections["training"]["eval_served_tau"] == 64  # the whole held-out set, not the trainer's 16
        assert sections["drafter"]["block_size"] == sections["training"]["block_size"] == 8
    assert "max_train_samples" not in parsed[0][1]["data"]
    assert [sections["data"]["max_train_samples"] for _, sections in parsed[1:]] == [2400, 5000]


def test_learning_curve_points_pair_each_evaluation_with_chats_seen_and_epochs():
    log = {
        "eval_served": [
            {"step": 300, "eval_served_tau": 1.15, "eval_all_anchor_tau": 1.2},
            {"step": 600, "eval_served_tau": 1.25, "eval_all_anchor_tau": 1.3},
        ]
    }
    points = curve.curve_points(log, batch_size=4, train_samples=2400)
    assert points == [
        {"step": 300, "chats_seen": 1200, "epochs": 0.5, "served_tau": 1.15, "all_anchor_tau": 1.2},
        {"step": 600, "chats_seen": 2400, "epochs": 1.0, "served_tau": 1.25, "all_anchor_tau": 1.3},
    ]


def train_variant_configs(monkeypatch, tmp_path, spec: str) -> list[dict]:
    """The configs `train_on_gpu.train_variant` trains for `spec` (training itself faked: each fake run
    ticks the callbacks' clocks once per step and reports a finished run)."""
    import argparse

    import hf_dflash.trainer.train as train

    configs = []

    def fake_train_from_config(config, callbacks=None):
        configs.append(config)
        for step in range(config["training"]["max_steps"]):
            for callback in callbacks or []:
                callback.times.append(float(step))
        return None

    monkeypatch.setattr(train, "train_from_config", fake_train_from_config)
    now = 1_000_000.0  # the script's clock stands still: the budget does not depend on how busy the machine is
    monkeypatch.setattr(train_on_gpu, "time", SimpleNamespace(time=lambda: now, strftime=time.strftime))
    args = argparse.Namespace(
        variant=[spec], out=str(tmp_path), device="cpu", memory_fraction=1.0, calibration_steps=4, deadline=now + 100,
        data="data/smollm2-135m-instruct", target="smollm2-135m-instruct", eval_samples=64, eval_part=None,
        block_size=16, num_anchors=8, train_batch_size=2, seed=0,
    )  # fmt: skip
    train_on_gpu.train_variant(args)
    return configs


def test_a_variant_with_max_steps_trains_exactly_those_steps_with_its_evaluations(monkeypatch, tmp_path):
    (config,) = train_variant_configs(monkeypatch, tmp_path, "C:training.max_steps=40,training.eval_steps=10")
    assert config["training"]["max_steps"] == 40  # no timing run: the variant fixed its length
    assert config["training"]["eval_strategy"] == "steps" and config["training"]["eval_steps"] == 10
    assert config["training"]["output_dir"] == str(tmp_path / "drafters" / "C")


def test_a_budgeted_variant_is_timed_first_then_fitted_into_the_budget(monkeypatch, tmp_path):
    calibration, run = train_variant_configs(monkeypatch, tmp_path, "B:num_hidden_layers=1")
    assert calibration["training"]["max_steps"] == 4 and calibration["training"]["eval_strategy"] == "no"
    assert calibration["training"]["output_dir"].endswith("B-calibration")
    # 1 s per timed step (the fake run's clock); 100 s left minus the 45 s reserved for loading and saving
    assert run["training"]["max_steps"] == 55 and run["training"]["eval_strategy"] == "steps"


offline_subset = load_module("scripts/offline_subset.py")


def test_offline_subset_holds_out_the_fixed_chats_last_and_refuses_other_settings(tmp_path, capsys):
    from hf_dflash.data.packed import PackedDataset, pack_tokenized
    from hf_dflash.data.tokenized import TokenizedDataset
    from hf_dflash.trainer.train import held_out_indices
    from tests.helpers.data import SETTINGS, make_char_tokenizer, sample, write_tokenized

    packed, tok = tmp_path / "packed", make_char_tokenizer()
    write_tokenized(tmp_path / "a", "tokenized-00000.jsonl", [sample(i) for i in range(6)])
    write_tokenized(tmp_path / "b", "tokenized-00000.jsonl", [sample(i, "math") for i in range(4)])
    pack_tokenized(tmp_path / "a", packed, part="train", settings=SETTINGS, tokenizer=tok)
    pack_tokenized(tmp_path / "b", packed, part="held", settings=SETTINGS, tokenizer=tok)
    out = tmp_path / "subset"
    args = ["--data", str(packed), "--out", str(out), "--samples", "4", "--eval-part", "held", "--eval-samples", "2"]
    assert offline_subset.main(args) == 0

    lines = [json.loads(line) for path in sorted(out.glob("tokenized-*.jsonl")) for line in path.open()]
    packed_ids = [s["id"] for s in PackedDataset(packed).samples]
    record = json.loads((out / "subset.json").read_text())
    assert record["held_out_ids"] == ["math:0", "math:1"]  # the first 2 of the held-out part ...
    assert [s["id"] for s in lines[-2:]] == ["math:0", "math:1"]  # ... last: `data.eval_samples: 2` holds them out
    assert len(TokenizedDataset(out)) == 6 and held_out_indices(TokenizedDataset(out), 2) == [4, 5]
    assert [s["id"] for s in lines[:-2]] == record["train_ids"]
    assert len(set(record["train_ids"])) == 4 and set(record["train_ids"]) <= set(packed_ids) - {"math:0", "math:1"}
    assert record["train_ids"] == sorted(record["train_ids"], key=packed_ids.index)  # dataset order
    # The same settings again: left alone; other settings: refused, nothing overwritten.
    assert offline_subset.main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert offline_subset.main([*args[:-5], "3", *args[-4:]]) == 2
    assert "offline_subset.py: error:" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert (
        offline_subset.main(
            [
                "--data",
                str(packed),
                "--out",
                str(tmp_path / "x"),
                "--samples",
                "4",
                "--eval-part",
                "held",
                "--eval-samples",
                "9",
            ]
        )
        == 2
    )
    assert "fewer than --eval-samples" in capsys.readouterr().err
    # Issue 25 B6: a negative count held out all but the last chats of the part ([:-1]); now an error.
    bad = ["--data", str(packed), "--out", str(tmp_path / "y"), "--samples", "4", "--eval-part", "held"]
    for extra, fragment in [(["--eval-samples", "-1"], "--eval-samples -1"), (["--samples", "-3"], "--samples -3")]:
        assert offline_subset.main([*bad, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("offline_subset.py: error:") and fragment in err, err
    assert not (tmp_path / "y").exists()
    # an unreadable packed folder: named, exit 2, no traceback
    assert offline_subset.main([*bad[:1], str(tmp_path / "nowhere"), *bad[2:]]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_offline_subset_excludes_the_chats_of_earlier_subsets(tmp_path, capsys):
    """`--exclude subset.json` (repeatable) draws only chats those subsets did not: a drafter trained
    further on an earlier one's weights then sees chats it has not seen."""
    from hf_dflash.data.packed import pack_tokenized
    from tests.helpers.data import SETTINGS, make_char_tokenizer, sample, write_tokenized

    packed, tok = tmp_path / "packed", make_char_tokenizer()
    write_tokenized(tmp_path / "a", "tokenized-00000.jsonl", [sample(i) for i in range(8)])
    write_tokenized(tmp_path / "b", "tokenized-00000.jsonl", [sample(i, "math") for i in range(3)])
    pack_tokenized(tmp_path / "a", packed, part="train", settings=SETTINGS, tokenizer=tok)
    pack_tokenized(tmp_path / "b", packed, part="held", settings=SETTINGS, tokenizer=tok)
    common = ["--data", str(packed), "--eval-part", "held", "--eval-samples", "2"]
    assert offline_subset.main([*common, "--out", str(tmp_path / "first"), "--samples", "3"]) == 0
    first = json.loads((tmp_path / "first" / "subset.json").read_text())
    assert (
        offline_subset.main(
            [
                *common,
                "--out",
                str(tmp_path / "second"),
                "--samples",
                "3",
                "--seed",
                "1",
                "--exclude",
                str(tmp_path / "first" / "subset.json"),
            ]
        )
        == 0
    )
    second = json.loads((tmp_path / "second" / "subset.json").read_text())
    assert not set(second["train_ids"]) & set(first["train_ids"])
    assert second["settings"]["exclude"] == [{"path": str(tmp_path / "first" / "subset.json"), "train_ids": 3}]
    # 9 chats outside the held-out 2, 3 excluded: 6 left, and asking for more names what is left.
    assert (
        offline_subset.main(
            [
                *common,
                "--out",
                str(tmp_path / "third"),
                "--samples",
                "7",
                "--exclude",
                str(tmp_path / "first" / "subset.json"),
            ]
        )
        == 2
    )
    assert "the 6 training samples" in capsys.readouterr().err
    argv = [*common, "--out", str(tmp_path / "fourth"), "--samples", "2", "--exclude", str(tmp_path / "missing.json")]
    assert offline_subset.main(argv) == 2
    assert re.search("--exclude .*missing.json", capsys.readouterr().err)


def test_offline_subset_draws_from_the_given_parts_and_never_from_a_reserved_set(tmp_path, capsys):
    """`--parts` draws only there (new data); `--reserve PART` keeps the first --eval-samples of PART out of
    training (a second held-out set, e.g. a new domain's)."""
    from hf_dflash.data.packed import pack_tokenized
    from tests.helpers.data import SETTINGS, make_char_tokenizer, sample, write_tokenized

    packed, tok = tmp_path / "packed", make_char_tokenizer()
    for part, source, count in [("old", "code", 5), ("held", "math", 3), ("new", "story", 6)]:
        write_tokenized(tmp_path / part, "tokenized-00000.jsonl", [sample(i, source) for i in range(count)])
        pack_tokenized(tmp_path / part, packed, part=part, settings=SETTINGS, tokenizer=tok)
    common = ["--data", str(packed), "--eval-part", "held", "--eval-samples", "2", "--parts", "new"]
    assert offline_subset.main([*common, "--out", str(tmp_path / "a"), "--samples", "4", "--reserve", "new"]) == 0
    record = json.loads((tmp_path / "a" / "subset.json").read_text())
    assert sorted(record["train_ids"]) == ["story:2", "story:3", "story:4", "story:5"]  # not story:0-1, no code
    assert record["held_out_ids"] == ["math:0", "math:1"]
    assert record["settings"]["parts"] == ["new"] and record["settings"]["reserve"] == ["new"]
    assert offline_subset.main([*common, "--out", str(tmp_path / "b"), "--samples", "5", "--reserve", "new"]) == 2
    assert "the 4 training samples" in capsys.readouterr().err
    assert offline_subset.main([*common[:-1], "nope", "--out", str(tmp_path / "c"), "--samples", "1"]) == 2
    assert "['nope'] are not in the packed data" in capsys.readouterr().err


def test_offline_subset_trains_on_every_chat_of_an_included_part_and_reserves_a_given_count(tmp_path, capsys):
    """`--include-all PART` trains on all of a small new part (not left to the draw); `--reserve PART:N` holds out
    its first N chats only."""
    from hf_dflash.data.packed import pack_tokenized
    from tests.helpers.data import SETTINGS, make_char_tokenizer, sample, write_tokenized

    packed, tok = tmp_path / "packed", make_char_tokenizer()
    for part, source, count in [("old", "code", 8), ("held", "math", 3), ("long", "story", 6)]:
        write_tokenized(tmp_path / part, "tokenized-00000.jsonl", [sample(i, source) for i in range(count)])
        pack_tokenized(tmp_path / part, packed, part=part, settings=SETTINGS, tokenizer=tok)
    common = ["--data", str(packed), "--eval-part", "held", "--eval-samples", "2", "--include-all", "long"]
    argv = [*common, "--out", str(tmp_path / "a"), "--samples", "3", "--reserve", "long:1"]
    assert offline_subset.main(argv) == 0
    record = json.loads((tmp_path / "a" / "subset.json").read_text())
    train = record["train_ids"]
    assert [i for i in train if i.startswith("story")] == [f"story:{i}" for i in range(1, 6)]  # all but the first
    assert len([i for i in train if not i.startswith("story")]) == 3 and not {"math:0", "math:1"} & set(train)
    assert record["settings"]["include_all"] == ["long"] and record["settings"]["reserve"] == ["long:1"]
    # without a count the part reserves --eval-samples chats; the draw never reaches into an included part
    assert offline_subset.main([*common, "--out", str(tmp_path / "b"), "--samples", "8", "--reserve", "long"]) == 0
    train = json.loads((tmp_path / "b" / "subset.json").read_text())["train_ids"]
    assert sorted(i for i in train if i.startswith("story")) == [f"story:{i}" for i in range(2, 6)]
    assert offline_subset.main([*common, "--out", str(tmp_path / "c"), "--samples", "10"]) == 2
    assert "the 9 training samples" in capsys.readouterr().err  # 8 code chats and math:2
    assert offline_subset.main([*common, "--out", str(tmp_path / "d"), "--samples", "1", "--reserve", "long:x"]) == 2
    assert "--reserve long:x" in capsys.readouterr().err
    # PART:-N holds out the last N (the set `heldout_tau.py --parts PART --samples N` scores), of any part
    argv = [*common, "--out", str(tmp_path / "e"), "--samples", "6", "--reserve", "long:-2", "--reserve", "old:-3"]
    assert offline_subset.main(argv) == 0
    train = json.loads((tmp_path / "e" / "subset.json").read_text())["train_ids"]
    assert sorted(i for i in train if i.startswith("story")) == [f"story:{i}" for i in range(4)]
    assert sorted(i for i in train if i.startswith("code")) == [f"code:{i}" for i in range(5)]
    assert offline_subset.main([*common, "--out", str(tmp_path / "f"), "--samples", "1", "--reserve", "long:0"]) == 2
    assert "other than 0" in capsys.readouterr().err
    # both ends of one part (a growing part: the chats an earlier subset saw, and those packed after it)
    argv = [*common, "--out", str(tmp_path / "g"), "--samples", "1", "--reserve", "long:1", "--reserve", "long:-2"]
    assert offline_subset.main(argv) == 0
    train = json.loads((tmp_path / "g" / "subset.json").read_text())["train_ids"]
    assert sorted(i for i in train if i.startswith("story")) == [f"story:{i}" for i in range(1, 4)]
    for twice in (["long:1", "long"], ["long:-1", "long:-2"]):  # the same end twice is ambiguous
        argv = [*common, "--out", str(tmp_path / "h"), "--samples", "1", "--reserve", twice[0], "--reserve", twice[1]]
        assert offline_subset.main(argv) == 2
        assert "long is reserved twice from its" in capsys.readouterr().err
    # --samples 0: the included parts alone (a new part's chats, to add to a subset drawn before)
    assert offline_subset.main([*common, "--out", str(tmp_path / "i"), "--samples", "0", "--reserve", "long:1"]) == 0
    train = json.loads((tmp_path / "i" / "subset.json").read_text())["train_ids"]
    assert train == [f"story:{i}" for i in range(1, 6)]
    argv = ["--data", str(packed), "--eval-part", "held", "--eval-samples", "2", "--out", str(tmp_path / "j")]
    argv += ["--samples", "0"]
    assert offline_subset.main(argv) == 2
    assert "--samples 0 draws nothing: name the parts to take whole with --include-all" in capsys.readouterr().err


regenerate_range = load_module("scripts/regenerate_range.py")


def test_regenerate_range_refuses_a_negative_or_out_of_range_span(tmp_path, monkeypatch, capsys):
    """Issue 25 B6: `--start -2` regenerated the last two prompts (a Python slice) and an `--end` past the
    corpus was clamped; both are errors, found before the target loads."""
    import hf_dflash.targets

    assert regenerate_range.prompt_range(10, 0, None) == (0, 10)
    assert regenerate_range.prompt_range(10, 3, 7) == (3, 7)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "messages": []}) + "\n" for i in range(10)))

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the range was checked")

    monkeypatch.setattr(hf_dflash.targets, "load_target", no_target)
    common = ["--part", "p", "--prompts", str(prompts), "--work", str(tmp_path / "work")]
    for span, fragment in [
        (["--start", "-2"], "--start -2: must be a prompt index in [0, 10)"),
        (["--start", "10"], "--start 10"),
        (["--start", "3", "--end", "11"], "--end 11: must be in (3, 10]"),
        (["--start", "3", "--end", "3"], "--end 3"),
        (["--start", "3", "--end", "-1"], "--end -1"),
    ]:
        assert regenerate_range.main([*common, *span]) == 2
        err = capsys.readouterr().err
        assert err.startswith("regenerate_range.py: error:") and fragment in err, err
    assert not (tmp_path / "work").exists()


def test_regenerate_range_notes_the_threads_the_regeneration_ran_with_not_those_given_to_pack(tmp_path):
    """A part regenerated with 2 threads and packed by a call with the default 1 says 2 in its manifest note; a
    resumed run with another count adds it."""
    work = tmp_path / "work"
    assert regenerate_range.threads_used(work) == "an unrecorded number of"
    regenerate_range.record_threads(work, 2)
    regenerate_range.record_threads(work, 2)
    assert regenerate_range.threads_used(work) == "2"
    regenerate_range.record_threads(work, 1)
    assert regenerate_range.threads_used(work) == "1 or 2"


def test_regenerate_range_sources_keeps_only_those_sources_in_corpus_order(tmp_path, monkeypatch, capsys):
    """`--sources code,chat` regenerates only the range's prompts of those sources (a part aimed at what a drafter
    lacks), in corpus order; a source the range does not hold is an error naming the ones it does."""
    import hf_dflash.targets

    corpus = [{"id": f"{s}:{i}", "source": s, "messages": []} for i, s in enumerate("abcabcabca")]
    assert [p["id"] for p in regenerate_range.select_prompts(corpus, 2, 9, None)] == [
        "c:2", "a:3", "b:4", "c:5", "a:6", "b:7", "c:8"
    ]  # fmt: skip
    assert [p["id"] for p in regenerate_range.select_prompts(corpus, 2, 9, ["c", "a"])] == [
        "c:2", "a:3", "c:5", "a:6", "c:8"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"--sources d: .*they hold a, b, c"):
        regenerate_range.select_prompts(corpus, 2, 9, ["d"])

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in corpus))

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the sources were checked")

    monkeypatch.setattr(hf_dflash.targets, "load_target", no_target)
    argv = ["--part", "p", "--prompts", str(prompts), "--work", str(tmp_path / "w"), "--start", "0", "--sources", "z"]
    assert regenerate_range.main(argv) == 2
    assert "--sources z:" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


contaminated = load_module("scripts/contaminated_chats.py")


def test_contaminated_chats_names_prompts_sharing_a_13_word_run_and_offline_subset_leaves_them_out(tmp_path):
    """A chat whose prompt shares a 13-word run with an evaluation prompt (or is a short one word for word) is
    listed, a reply that does is not (only prompts are checked), and the list works as `--exclude`."""
    from hf_dflash.data.corpus import build_eval_index
    from hf_dflash.data.packed import PackedDataset, pack_tokenized
    from tests.helpers.data import SETTINGS, make_char_tokenizer, write_tokenized

    def evaluation(record_id, prompt):
        return {"id": record_id, "messages": [{"role": "user", "content": prompt}]}

    tok = make_char_tokenizer()
    leaked = "one two three four five six seven eight nine ten eleven twelve thirteen"
    index = build_eval_index(
        {"ifbench": [evaluation("ifbench:1", f"Please: {leaked} and more."), evaluation("ifbench:2", "Hi there")]}
    )

    def chat(i, prompt, reply="ok"):
        ids, answer = tok.encode(prompt), tok.encode(reply)
        return {"id": f"sharegpt:{i}", "input_ids": ids + answer, "loss_mask": [0] * len(ids) + [1] * len(answer)}

    chats = [
        chat(0, f"Now {leaked.upper()}, thanks"),  # the run, case and punctuation aside
        chat(1, "one two three four five six seven eight nine ten eleven twelve"),  # 12 words: not a run
        chat(2, "A question", reply=leaked),  # the reply holds it: not a prompt overlap
        chat(3, "hi, THERE!"),  # identical to a short evaluation prompt
        *[chat(i, f"an ordinary prompt {i}") for i in range(4, 8)],
    ]
    write_tokenized(tmp_path / "a", "tokenized-00000.jsonl", chats)
    pack_tokenized(tmp_path / "a", tmp_path / "packed", part="train", settings=SETTINGS, tokenizer=tok)
    hits = contaminated.contaminated_chats(PackedDataset(tmp_path / "packed").samples, tok.decode, index)
    assert [hit["id"] for hit in hits] == ["sharegpt:0", "sharegpt:3"]
    assert "13-gram with eval set ifbench id ifbench:1" in hits[0]["reason"]
    assert "identical to eval set ifbench id ifbench:2" in hits[1]["reason"]

    (tmp_path / "contaminated.json").write_text(json.dumps({"train_ids": [hit["id"] for hit in hits]}))
    argv = ["--data", str(tmp_path / "packed"), "--out", str(tmp_path / "subset"), "--samples", "6"]
    argv += ["--eval-part", "train", "--eval-samples", "0", "--exclude", str(tmp_path / "contaminated.json")]
    assert offline_subset.main(argv) == 0
    record = json.loads((tmp_path / "subset" / "subset.json").read_text())
    assert sorted(record["train_ids"]) == sorted(f"sharegpt:{i}" for i in (1, 2, 4, 5, 6, 7))
