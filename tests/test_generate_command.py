"""`hf-dflash generate`: batched DFlash over a prompt file gives the plain-decoding answers."""

import json

import pytest

from hf_dflash.cli import main
from hf_dflash.generation.verifying.compiling import choose_compile
from tests.conftest import make_drafter, make_target
from tests.helpers.data import make_char_tokenizer, write_lines

PROMPTS = [
    {"prompt": "Hello there"},
    {"prompt": "Write a loop."},
    {"prompt": "Why is the sky blue? Explain."},
    {"messages": [{"role": "user", "content": "Count to three."}]},
    {"prompt": "ok"},
]


def test_batched_generate_command_matches_plain(tmp_path, capsys):
    target = make_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    make_char_tokenizer().save_pretrained(tmp_path / "target")
    make_drafter(target, block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS)
    common = [
        "generate",
        "--prompts",
        str(prompts),
        "--target",
        str(tmp_path / "target"),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
        "--batch-size",
        "3",
    ]
    assert main([*common, "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "dflash.jsonl")]) == 0
    assert "τ" in capsys.readouterr().out
    shorter = ["--drafter", str(tmp_path / "drafter"), "--block-size-policy", "2", "--out", str(tmp_path / "k2.jsonl")]
    assert main([*common, *shorter]) == 0
    assert main([*common, "--drafter", "none", "--out", str(tmp_path / "plain.jsonl")]) == 0
    dflash = [json.loads(line) for line in (tmp_path / "dflash.jsonl").read_text().splitlines()]
    plain = [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    assert [row["id"] for row in dflash] == [row["id"] for row in plain] and len(dflash) == len(PROMPTS)
    assert [row["response"] for row in dflash] == [row["response"] for row in plain]
    k2 = [json.loads(line) for line in (tmp_path / "k2.jsonl").read_text().splitlines()]
    assert [row["response"] for row in k2] == [row["response"] for row in plain]
    assert all(row["new_tokens"] > 0 for row in dflash)


def test_generate_refuses_to_overwrite_before_any_work(tmp_path, capsys):
    """Issue 25 B4: --out never replaces an existing file without --overwrite, never its own --prompts file,
    and a folder is refused; all before any model loads (the target 'nope' would fail later)."""
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS)
    kept = tmp_path / "answers.jsonl"
    kept.write_text("precious\n")
    before = prompts.read_text()
    common = ["generate", "--prompts", str(prompts), "--target", "nope", "--drafter", "none"]
    cases = [
        (["--out", str(kept)], "exists", "--overwrite"),
        (["--out", str(prompts)], "is the input --prompts file", None),
        (["--out", str(prompts), "--overwrite"], "is the input --prompts file", None),
        (["--out", str(tmp_path)], "is a folder", None),
        (["--out", str(kept / "x.jsonl")], "is a file, not a folder", None),
    ]
    for extra, fragment, hint in cases:
        assert main([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert "hf-dflash generate: error: --out" in err and fragment in err and "Traceback" not in err, err
        assert hint is None or hint in err
    assert kept.read_text() == "precious\n" and prompts.read_text() == before


@pytest.mark.parametrize(
    "bad_line, fragment",
    [
        ('{"id": {"a": 1}, "prompt": "hi"}', '"id" must be a string or an integer, got dict {"a": 1}'),
        ('{"id": [1, 2], "prompt": "hi"}', '"id" must be a string or an integer, got list [1, 2]'),
        ('{"id": true, "prompt": "hi"}', '"id" must be a string or an integer, got bool true'),
        ('{"id": null, "prompt": "hi"}', '"id" must be a string or an integer, got NoneType null'),
        ('{"prompt": "bad \\ud800 half"}', '"prompt" holds a lone surrogate \\ud800 at character 4'),
        (
            '{"messages": [{"role": "user", "content": "x\\udc00"}]}',
            "message 0's content holds a lone surrogate \\udc00 at character 1",
        ),
        ('{"id": "\\ud800", "prompt": "hi"}', '"id" holds a lone surrogate'),
        ('{"id": "1", "prompt": "hi"}', "id '1' repeats line 1's id 1; ids are compared as text"),
        ('{"id": 2, "prompt": "hi"}', "id 2 repeats line 2 (no id: its number)"),
    ],
)
def test_a_bad_id_or_prompt_text_is_refused_with_its_line_before_any_work(tmp_path, capsys, bad_line, fragment):
    """Issue 36: an object or list id died in a TypeError (unhashable), a lone surrogate in a tokenizer TypeError
    after the models loaded, and ids 1 and "1" gave two answers with the same id "user:1"."""
    prompts = write_lines(tmp_path / "prompts.jsonl", ['{"id": 1, "prompt": "one"}', '{"prompt": "two"}', bad_line])
    argv = ["generate", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--target", "nope"]
    assert main([*argv, "--drafter", "none"]) == 2
    err = capsys.readouterr().err
    assert "hf-dflash generate: error:" in err and "prompts.jsonl, line 3:" in err and "Traceback" not in err, err
    assert fragment in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_lone_surrogate_in_a_dropped_assistant_turn_and_a_surrogate_pair_are_fine(tmp_path):
    from hf_dflash.data.corpus import read_prompts_file

    lines = [
        '{"prompt": "smile \\ud83d\\ude00"}',
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\\ud800"}, '
        '{"role": "user", "content": "b"}]}',
    ]
    records = read_prompts_file(write_lines(tmp_path / "prompts.jsonl", lines))
    assert records[0]["messages"][0]["content"] == "smile \U0001f600" and [r["id"] for r in records] == [
        "user:1",
        "user:2",
    ]


def test_generate_overwrite_replaces_an_earlier_answer_file(tmp_path, capsys):
    target = make_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    make_char_tokenizer().save_pretrained(tmp_path / "target")
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS[:2])
    out = tmp_path / "answers.jsonl"
    out.write_text("old\n")
    argv = ["generate", "--prompts", str(prompts), "--target", str(tmp_path / "target"), "--drafter", "none"]
    argv += ["--dtype", "float32", "--max-new-tokens", "3", "--out", str(out), "--overwrite"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all("response" in row for row in rows)


@pytest.mark.slow
def test_compiled_generate_command_gives_the_plain_answers(tmp_path, capsys):
    """`--compile on`: a static cache + torch.compile per call, batched DFlash, the same answers."""
    target = make_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    make_char_tokenizer().save_pretrained(tmp_path / "target")
    make_drafter(target, block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS[:2])
    common = ["generate", "--prompts", str(prompts), "--target", str(tmp_path / "target"), "--dtype", "float32",
              "--max-new-tokens", "10", "--batch-size", "2"]  # fmt: skip
    dflash = ["--drafter", str(tmp_path / "drafter"), "--compile", "on", "--out", str(tmp_path / "compiled.jsonl")]
    assert main([*common, *dflash]) == 0
    assert "compile: on" in capsys.readouterr().out
    assert main([*common, "--drafter", "none", "--compile", "off", "--out", str(tmp_path / "plain.jsonl")]) == 0
    assert "compile: off" in capsys.readouterr().out
    compiled = [json.loads(line) for line in (tmp_path / "compiled.jsonl").read_text().splitlines()]
    plain = [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    assert [row["response"] for row in compiled] == [row["response"] for row in plain]


def test_compile_auto_is_eager_on_cpu_and_compiled_on_cuda():
    assert choose_compile("auto", "cpu")[0] is False
    assert choose_compile("auto", "cuda")[0] is True
    assert choose_compile("on", "cpu") == (True, "on")
    assert choose_compile("off", "cuda") == (False, "off")
    with pytest.raises(ValueError, match="--compile must be one of auto, on, off"):
        choose_compile("yes", "cpu")


def test_the_drafter_defaults_to_the_shipped_one_and_is_required_where_none_is_shipped(tmp_path, capsys):
    """No untrained drafter by default: the default target gets the drafter in models/, any other target must name
    one (before any model loads: the target 'nope' would fail later)."""
    from hf_dflash.targets import DEFAULT_TARGET, SHIPPED_DRAFTERS, shipped_drafter

    assert shipped_drafter(DEFAULT_TARGET) == SHIPPED_DRAFTERS[DEFAULT_TARGET]
    assert (SHIPPED_DRAFTERS[DEFAULT_TARGET] / "config.json").is_file()
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS)
    argv = ["generate", "--prompts", str(prompts), "--target", "nope", "--out", str(tmp_path / "out.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "hf-dflash generate: error: No drafter is shipped for target 'nope'" in err and "'random'" in err, err


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("policy, fragment", [("bogus", "'bogus'"), ("9", "1 <= k <= 4")])
def test_a_bad_block_size_policy_is_refused_before_the_target_loads(
    tmp_path, capsys, monkeypatch, command, policy, fragment
):
    """Issue 53 item 9: the policy is checked against the block size the drafter's config.json records (read
    without loading anything); it used to be refused only after the target had loaded."""
    import hf_dflash.bench.loading as loading

    monkeypatch.setattr(loading, "load_any_target", lambda *a, **k: pytest.fail("the target loaded"))
    make_drafter(make_target("qwen3"), block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS)
    out = ["--out", str(tmp_path / ("answers.jsonl" if command == "generate" else "bench"))]
    argv = [command, "--prompts", str(prompts), "--target", str(tmp_path / "target"), "--drafter",
            str(tmp_path / "drafter"), "--block-size-policy", policy, *out]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-dflash {command}: error: block size policy {policy!r}") and fragment in error, error
    assert not (tmp_path / "answers.jsonl").exists() and not (tmp_path / "bench").exists()


def test_generate_and_bench_render_a_tokenizer_without_chat_template_alike_and_say_so(tmp_path, capsys):
    """Issue 53 item 9: a target folder whose tokenizer has no chat template (a base model): `generate` failed
    after loading with Transformers' chat-template error while `bench` ran on the running text; both now render
    the prompts as the training data does (BOS, then the messages back to back) and print which format applies."""
    target = make_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "target")
    make_drafter(target, block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS[:2])
    common = ["--prompts", str(prompts), "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
              "--dtype", "float32", "--max-new-tokens", "6"]  # fmt: skip
    assert main(["generate", *common, "--out", str(tmp_path / "answers.jsonl")]) == 0
    generated = capsys.readouterr().out
    assert main(["bench", *common, "--out", str(tmp_path / "bench"), "--methods", "plain,dflash", "--no-progress"]) == 0
    benched = capsys.readouterr().out
    expected = "prompt format: no chat template in the tokenizer: the running text"
    assert expected in generated.lower() and expected in benched.lower()
    assert len((tmp_path / "answers.jsonl").read_text().splitlines()) == 2
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["settings"]["prompt_format"].startswith("no chat template")
