"""`hf-dflash bench`: every method on the same prompts, the report, the model-card benchmark and the plots.

Tiny random Llama target (conftest) with the character-level ChatML tokenizer of test_data, saved as a
local folder so the command runs end to end; one `real_model` smoke run on SmolLM2 with a GSM8K prompt.
"""

import json

import pytest
import torch

from hf_dflash.bench import METHODS, generate_with, load_prompt_sets, run_bench
from hf_dflash.bench.card import divergence_note
from hf_dflash.bench.methods import COMPILED_METHODS, EAGER_METHODS, PLAIN_METHODS, ForwardRecorder, eager_method
from hf_dflash.bench.recompiles import CompileCounter
from hf_dflash.bench.report import format_table
from hf_dflash.bench.runner import Sample, rotated
from hf_dflash.bench.summary import OVERALL, summarize
from hf_dflash.cli import main
from hf_dflash.hub_cards import load_benchmark
from hf_dflash.hub_cards.schemas import BENCHMARK_SET_FIELDS, validate_benchmark
from tests.conftest import OracleDrafter, make_drafter, make_target
from tests.helpers.data import save_tiny_folders, write_lines

PROMPTS = [
    {"prompt": "Write a function that reverses a string."},
    {"prompt": "def add(a, b): return a + b  # add two numbers, add two numbers"},
    {
        "messages": [
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And another one?"},
        ]
    },  # two turns, as MT-Bench
]
METHOD_FIELDS = {
    "new_tokens",
    "seconds",
    "tok_s",
    "speedup",
    "tau",
    "rounds",
    "histogram",
    "mean_block",
    "identical",
    "divergences",
    "branch_shares",
    "round_costs",
    "compiles",
}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """The hybrid method times a cost model on first use: cache it in a temporary folder, not ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DFLASH_CACHE", str(tmp_path_factory.mktemp("hf_dflash_cache")))
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(target folder, drafter folder, prompts file): tiny fp32 target + tokenizer, block-4 random drafter."""
    root = tmp_path_factory.mktemp("bench")
    return *save_tiny_folders(root), write_lines(root / "mine.jsonl", PROMPTS)


def bench(folders, out, *extra) -> dict:
    target, drafter, prompts = folders
    argv = [
        "bench",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--prompts",
        str(prompts),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "20",
        "--num-prompts",
        "0",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]
    assert main(argv) == 0
    return json.loads((out / "bench.json").read_text())


@pytest.fixture(scope="module")
def greedy(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy")
    return bench(folders, out), out


def test_report_has_every_field_and_all_methods_equal_plain_greedy_in_fp32(greedy, capsys):
    report, out = greedy
    assert set(report) >= {
        "command",
        "machine",
        "settings",
        "methods",
        "sets",
        "overall",
        "divergences",
        "samples",
        "plots",
        "card",
    }
    assert report["methods"] == list(METHODS)
    assert report["command"].startswith("hf-dflash bench --target ")
    for row in [*report["sets"].values(), report["overall"]]:
        assert row["n"] == 3 and row["generations"] == 4  # the 2-turn prompt answers twice
        assert set(row["methods"]) == set(METHODS)
        # the baseline is the fastest plain decoding: plain (fp32 here), plain-alt (bf16), compiled and/or packed
        plain_rates = {method: row["methods"][method]["tok_s"] for method in PLAIN_METHODS}
        assert row["baseline"] == max(plain_rates, key=plain_rates.get)
        for method, stats in row["methods"].items():
            assert set(stats) == METHOD_FIELDS
            assert stats["new_tokens"] > 0 and stats["tok_s"] > 0
            assert stats["speedup"] == pytest.approx(stats["tok_s"] / max(plain_rates.values()))
            if method in ("plain", "plain-alt"):
                assert stats["identical"] is None and stats["tau"] is None
            elif method in PLAIN_METHODS:  # compiled and/or packed fp32 plain greedy: the same tokens, no rounds
                assert stats["identical"] is True and stats["tau"] is None
            else:
                assert stats["identical"] is True and stats["divergences"] == 0
                assert sum(stats["histogram"]) == stats["rounds"] > 0
                assert stats["tau"] == pytest.approx(
                    sum(t * count for t, count in enumerate(stats["histogram"], 1)) / stats["rounds"]
                )
            if eager_method(method) in ("hybrid", "hybrid-tree"):
                assert sum(stats["branch_shares"].values()) == pytest.approx(1.0)
                assert stats["branch_shares"]["bonus"] == pytest.approx(1 / stats["tau"])
                costs = stats["round_costs"]
                # rounds after the prefill (a prefill that verified n-gram drafts is a round, not timed as one)
                assert stats["rounds"] - row["generations"] <= costs["rounds"] <= stats["rounds"]
                assert costs["mean_target_ms"] > 0
                assert sum(entry["rounds"] for entry in costs["by_tree_size"].values()) == costs["rounds"]
            elif eager_method(method) == "tree":  # every round is one tree forward (its size from the cost curve)
                assert stats["branch_shares"] is None and stats["round_costs"]["rounds"] == stats["rounds"]
            else:
                assert stats["branch_shares"] is None and stats["round_costs"] is None
    assert report["divergences"] == []
    samples = report["samples"]
    assert len(samples) == 4 * len(METHODS) and {sample["turn"] for sample in samples} == {0, 1}
    assert all(sample["identical"] for sample in samples if sample["method"] not in ("plain", "plain-alt"))
    assert report["settings"]["dtypes"] == {"plain": "float32", "plain-alt": "bfloat16"}
    assert "plain float32, plain-alt bfloat16" in format_table(report)
    # every method's first call is untimed; plain-compiled's compiles the decoding step, reported apart
    assert set(report["settings"]["warmup_seconds"]) == set(METHODS)
    assert "plain-compiled: compiled in its warm-up call" in format_table(report)
    for method in COMPILED_METHODS:
        assert f"{method}: compiled in its warm-up call" in format_table(report)


def test_card_validates_and_is_written_for_export(greedy):
    report, out = greedy
    card = validate_benchmark(report["card"])
    assert set(card) == {"command", "machine", "settings", "sets"}
    (row,) = card["sets"].values()
    assert set(row) == set(BENCHMARK_SET_FIELDS) and row["identical"] is True
    mine = report["sets"]["mine"]
    dflash = mine["methods"]["dflash"]
    assert row["tau"] == round(dflash["tau"], 2) and row["speedup"] == round(dflash["speedup"], 2)
    assert row["plain_tok_s"] == round(mine["methods"][mine["baseline"]]["tok_s"], 1)  # the faster plain
    assert "divergences" not in card["settings"]  # fp32: every answer equals plain greedy
    assert load_benchmark(out / "benchmark.json") == card


def test_divergence_note_counts_our_answers_and_the_largest_gap():
    entries = [
        {"method": "dflash", "logit_gap": 0.125},
        {"method": "lookup", "logit_gap": 3.0},
        {"method": "dflash", "logit_gap": 0.0},
    ]
    assert divergence_note(entries, 28) == (
        "2 of 28 DFlash answers differ from plain greedy; at each first difference the target's top-2 logit gap is <= 0.125"
    )
    assert divergence_note([{"method": "lookup", "logit_gap": 1.0}], 3) is None


def test_plots_exist(greedy):
    report, out = greedy
    assert set(report["plots"]) == {"acceptance_mine.png", "acceptance_overall.png", "speedup.png"}
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampling_mode_reports_tau_and_speedup_without_identity(folders, tmp_path):
    methods = ["--methods", "plain,dflash,builtin,tree,hybrid"]
    report = bench(
        folders, tmp_path, "--temperature", "0.8", "--draft-temperature", "0", *methods, "--drafter", "random"
    )
    assert "RANDOM" in report["settings"]["drafter"] and report["settings"]["temperature"] == 0.8
    assert report["settings"]["draft_temperature"] == 0.0
    for method, stats in report["overall"]["methods"].items():
        assert stats["identical"] is None and stats["speedup"] > 0
        assert (stats["tau"] is None) == (method == "plain")
    card = validate_benchmark(report["card"])
    assert "not applicable" in card["settings"]["identity_check"]


def test_builtin_and_lookup_rounds_read_off_the_forwards(monkeypatch):
    """With an always-right drafter both DFlash loops commit the same rounds; every method accounts for
    every new token (DFlash loops: all but the prefill's)."""
    # "auto" sizes trees by the machine's measured costs (a loaded machine may find no tree worth it): fixed
    monkeypatch.setattr("hf_dflash.bench.methods.TREE_SETTING", 8)
    target = make_target("llama")
    inputs = {"input_ids": torch.tensor([[1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])}
    kwargs = {"do_sample": False, "max_new_tokens": 30, "eos_token_id": None}
    plain = target.generate(**inputs, **kwargs)
    drafter = OracleDrafter(make_drafter(target, block_size=4).config, target.lm_head.weight, plain).eval()
    drafter.block_size_policy = 4  # hybrid: the whole block in every tree (the default budget times the machine)
    runs, acceptance = {}, {}
    for method in METHODS:
        runs[method] = generate_with(method, target, drafter, inputs, kwargs)
        acceptance[method] = getattr(drafter, "last_acceptance", None)
    assert all(torch.equal(run.sequences, plain) for run in runs.values())
    assert runs["builtin"].acceptance_lengths == runs["dflash"].acceptance_lengths
    assert max(runs["dflash"].acceptance_lengths) == 4
    assert sum(runs["builtin"].acceptance_lengths) == 30 - 1 and sum(runs["lookup"].acceptance_lengths) == 30
    assert runs["plain"].acceptance_lengths is None
    assert sum(runs["tree"].acceptance_lengths) == 30 - 1 and max(runs["tree"].acceptance_lengths) == 4
    for method in ("hybrid", "hybrid-tree"):
        hybrid = runs[method]
        stats = acceptance[method]
        prefill_token = not stats.first_round_in_prefill  # the prefill verified n-gram drafts, or not
        assert sum(hybrid.acceptance_lengths) == sum(hybrid.branches.values()) == 30 - prefill_token
        assert hybrid.branches["block"] + hybrid.branches["shared"] > 0  # the always-right block is accepted
        assert [size for size, _ in hybrid.round_costs] == stats.tree_sizes[1 - prefill_token :]
        assert all(seconds > 0 for _, seconds in hybrid.round_costs)
    # hybrid-tree grafts the n-gram branch onto the drafter's 8-node tree: the same rounds, bigger trees
    sizes = {method: acceptance[method].tree_sizes for method in ("hybrid", "hybrid-tree")}
    assert len(sizes["hybrid"]) == len(sizes["hybrid-tree"])
    assert all(grown >= plain for plain, grown in zip(sizes["hybrid"], sizes["hybrid-tree"], strict=True))
    assert sum(sizes["hybrid-tree"]) > sum(sizes["hybrid"])


def test_recorder_without_position_ids_fails_loudly():
    target = make_target("llama")
    with pytest.raises(RuntimeError, match="position_ids"), ForwardRecorder(target):
        target(torch.tensor([[1, 2, 3]]))


def timed(method: str, seconds: float, compiles: int | None) -> Sample:
    """A 10-token plain answer of `method` in `seconds`, with `compiles` graphs compiled while timed."""
    return Sample("mine", "p0", 0, method, 5, 10, seconds, None, None, None, None, compiles=compiles)


@pytest.mark.parametrize("compiles", [0, 3])
def test_a_compiled_row_that_compiled_while_timed_is_flagged_and_never_the_baseline(compiles):
    """The compiled plain row is the fastest; if it compiled graphs while timed (its warm-up did not settle) it
    is flagged with the count and the reason, and the baseline falls to the fastest settled plain row."""
    samples = [timed("plain", 1.0, None), timed("plain-packed", 0.8, None), timed("plain-compiled", 0.5, compiles)]
    summary = summarize(samples, ["plain", "plain-packed", "plain-compiled"], block_size=4)
    overall = summary[OVERALL]
    assert overall["methods"]["plain-compiled"]["compiles"] == compiles
    assert overall["methods"]["plain"]["compiles"] is None
    report = {"settings": {}, "sets": summary["sets"], OVERALL: overall, "methods": list(overall["methods"])}
    table = format_table({**report, "divergences": []})
    if compiles:
        assert overall["baseline"] == "plain-packed"
        assert overall["methods"]["plain-compiled"]["speedup"] == pytest.approx(1.6)
        assert list(overall["unsettled"]) == ["plain-compiled"] and "3 graph(s) while timed" in table
        assert "(UNSETTLED)" in table
    else:
        assert overall["baseline"] == "plain-compiled" and overall["unsettled"] == {}
        assert "UNSETTLED" not in table


def test_compile_counter_counts_the_graphs_dynamo_compiles_inside_it():
    """Each new Python int the function reads is a guard failure and a recompile (dynamic=False)."""
    compiled = torch.compile(lambda x, n: x * n, backend="eager", dynamic=False)
    compiled(torch.ones(2), 1)  # warm-up, outside the counter
    with CompileCounter() as counter:
        compiled(torch.ones(2), 1)
    assert counter.count == 0
    with CompileCounter() as counter:
        compiled(torch.ones(2), 2)
        compiled(torch.ones(2), 3)
    assert counter.count == 2
    compiled(torch.ones(2), 4)
    assert counter.count == 2  # closed: no longer counting


def test_method_order_rotates_per_prompt():
    assert [rotated(METHODS, index)[0] for index in range(len(METHODS) + 1)] == [*METHODS, METHODS[0]]


def test_bad_inputs_are_named(folders, tmp_path, capsys):
    target, drafter, prompts = folders
    with pytest.raises(ValueError, match="Unknown benchmark set"):
        load_prompt_sets(["gsm9k"])
    with pytest.raises(ValueError, match="Unknown or no methods"):
        run_bench(str(target), str(drafter), sets=[], prompts=str(prompts), methods=["plain", "medusa"], out=tmp_path)
    with pytest.raises(ValueError, match="block size policy '99'"):
        run_bench(str(target), str(drafter), sets=[], prompts=str(prompts), block_size_policy="99", out=tmp_path)
    assert main(["bench", "--target", "nope", "--drafter", "random", "--prompts", str(prompts)]) == 2
    assert "Unknown target 'nope'" in capsys.readouterr().err


@pytest.mark.real_model
def test_smollm2_smoke_on_one_gsm8k_prompt(real_target, tmp_path):
    """Every eager method and one compiled one on the real target (the tiny-model bench above runs every compiled
    method: each compiles the target again, ~10 s apiece here, several times that on a CPU without native bf16)."""
    report = run_bench(
        "smollm2-135m-instruct",
        "random",
        sets=["gsm8k"],
        methods=[*EAGER_METHODS, "dflash-compiled"],
        num_prompts=1,
        max_new_tokens=16,
        dtype="float32",
        out=tmp_path,
        progress=False,
    )
    assert report["overall"]["n"] == 1
    assert all(stats["identical"] in (None, True) for stats in report["overall"]["methods"].values())
    assert report["sets"]["gsm8k"]["methods"]["dflash"]["tau"] == pytest.approx(1.0, abs=0.5)
    validate_benchmark(report["card"])


@pytest.mark.real_model  # reads the pinned evaluation packages (make test installs them)
def test_long_prompt_sets_hold_long_english_documents_with_a_task():
    from hf_dflash.bench.prompts import BENCH_SETS, LONG_PROMPT_CHARS, select_prompt_sets

    for name, source in (("long-docs", "writingbench"), ("long-code", "arena-hard")):
        records = BENCH_SETS[name]()
        assert len(records) >= 30, name
        assert {record["source"] for record in records} == {name}
        assert all(record["id"].startswith(f"{source}:") for record in records)
        texts = [record["messages"][-1]["content"] for record in records]
        assert all(LONG_PROMPT_CHARS[0] <= len(text) <= LONG_PROMPT_CHARS[1] for text in texts), name
        assert all(sum(char.isascii() for char in text) >= 0.95 * len(text) for text in texts), name
        first, _ = select_prompt_sets([name], num_prompts=3, seed=0)
        again, sizes = select_prompt_sets([name], num_prompts=3, seed=0)
        assert first == again and sizes[name] == len(records)
