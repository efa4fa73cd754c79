"""The CLI's user errors (issue #13 B8): `hf-dflash <cmd>: error: ...` on stderr and a non-zero exit,
never a traceback or a silent success; `bench --prompts FILE` runs the whole file."""

import json
import os
from pathlib import Path

import pytest
import torch

import hf_dflash.data.corpus as corpus
import hf_dflash.data.pipeline as pipeline
from hf_dflash.cli import main
from tests.conftest import make_target
from tests.helpers.data import EVAL_SUITE, make_char_tokenizer, save_tiny_folders, write_lines


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(target folder with tokenizer, drafter folder, a 10-prompt file, an empty prompt file)."""
    root = tmp_path_factory.mktemp("cli")
    prompts = write_lines(root / "ten.jsonl", [{"prompt": f"Count to {i}."} for i in range(10)])
    empty = write_lines(root / "empty.jsonl", ["", "   "])
    return *save_tiny_folders(root), prompts, empty


def fails_cleanly(capsys, argv, command, *fragments):
    """`main(argv)` exits 2 (returned or via argparse) with `hf-dflash <command>: error:` and no traceback."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)  # argparse and the error path (user_errors) agree
    assert f"hf-dflash {command}: error:" in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_missing_prompts_file_is_named(folders, tmp_path, capsys):
    target, drafter, _, _ = folders
    missing = str(tmp_path / "nope.jsonl")
    fails_cleanly(
        capsys,
        [
            "generate",
            "--prompts",
            missing,
            "--out",
            str(tmp_path / "o.jsonl"),
            "--target",
            str(target),
            "--drafter",
            str(drafter),
        ],
        "generate",
        "nope.jsonl",
        "does not exist",
    )
    fails_cleanly(
        capsys,
        ["bench", "--prompts", missing, "--target", str(target), "--drafter", "random", "--out", str(tmp_path / "b")],
        "bench",
        "nope.jsonl",
        "does not exist",
    )
    fails_cleanly(
        capsys,
        ["prepare-data", "--out", str(tmp_path / "d"), "--sources", "", "--prompts", missing],
        "prepare-data",
        "nope.jsonl",
        "does not exist",
    )
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "b").exists()


def test_device_cuda_without_cuda_is_named(folders, tmp_path, capsys, monkeypatch):
    target, drafter, prompts, _ = folders
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails_cleanly(
        capsys,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "b"),
        ],
        "bench",
        "--device cuda",
        "CUDA",
    )
    fails_cleanly(
        capsys,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--device",
            "gpu0",
            "--out",
            str(tmp_path / "b"),
        ],
        "bench",
        "--device 'gpu0'",
    )


def test_a_negative_temperature_is_refused(folders, tmp_path, capsys):
    target, drafter, prompts, _ = folders
    fails_cleanly(
        capsys,
        ["bench", "--prompts", str(prompts), "--target", str(target), "--drafter", str(drafter), "--temperature", "-1"],
        "bench",
        "--temperature",
        "-1",
    )
    fails_cleanly(
        capsys, ["prepare-data", "--out", str(tmp_path / "d"), "--temperature", "-1"], "prepare-data", "--temperature"
    )


def test_an_empty_prompt_file_is_refused(folders, tmp_path, capsys):
    target, drafter, _, empty = folders
    fails_cleanly(
        capsys,
        [
            "generate",
            "--prompts",
            str(empty),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--target",
            str(target),
            "--drafter",
            str(drafter),
        ],
        "generate",
        "empty.jsonl",
        "no prompts",
    )
    fails_cleanly(
        capsys,
        [
            "bench",
            "--prompts",
            str(empty),
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--out",
            str(tmp_path / "b"),
        ],
        "bench",
        "empty.jsonl",
        "no prompts",
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_prepare_data_with_no_sample_left_is_an_error(tmp_path, monkeypatch, capsys):
    prompts = write_lines(tmp_path / "mine.jsonl", [{"prompt": f"Tell me about number {i}."} for i in range(3)])
    monkeypatch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
    monkeypatch.setattr(pipeline, "load_target", lambda name, dtype: (make_target("llama"), make_char_tokenizer()))
    # 12 new tokens per reply can never reach 2 x block 16 supervised tokens: every sample is dropped.
    fails_cleanly(
        capsys,
        [
            "prepare-data",
            "--out",
            str(tmp_path / "out"),
            "--sources",
            "",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--block-size",
            "16",
            "--max-length",
            "256",
        ],
        "prepare-data",
        "0 training samples",
        "--block-size",
    )


def test_bench_runs_every_prompt_of_a_file_and_says_how_many(folders, tmp_path, capsys):
    target, drafter, prompts, _ = folders
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
        "3",
        "--methods",
        "plain,dflash",
        "--out",
        str(tmp_path / "all"),
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "all" / "bench.json").read_text())
    assert report["sets"]["ten"]["n"] == 10  # not the 8 that --num-prompts defaults to for the built-in sets
    assert "ten: 10 of 10 prompts" in out
    assert main([*argv[:-3], "--out", str(tmp_path / "three"), "--num-prompts", "3", "--no-progress"]) == 0
    assert json.loads((tmp_path / "three" / "bench.json").read_text())["sets"]["ten"]["n"] == 3
    assert "ten: 3 of 10 prompts" in capsys.readouterr().out


def test_one_error_path_for_user_errors_and_tracebacks_for_bugs(tmp_path, capsys):
    """Issue 25: ValueError, OSError (FileExistsError, IsADirectoryError, ...), SafetensorError and a refused
    pickle print `<prog>: error: ...` and exit 2; a programming error (KeyError, TypeError) still raises."""
    import pickle

    from safetensors import SafetensorError

    from hf_dflash.user_errors import run_reporting_errors

    def raising(error):
        def work():
            raise error

        return work

    cases = [
        (ValueError("bad --x 3: use 4"), "bad --x 3: use 4"),
        (IsADirectoryError(21, "Is a directory", str(tmp_path)), f"{tmp_path}: Is a directory"),
        (FileExistsError(17, "File exists", "a.json"), "a.json: File exists"),
        (SafetensorError("Error while deserializing header"), "SafetensorError: Error while deserializing header"),
        (pickle.UnpicklingError("Weights only load failed"), "UnpicklingError: Weights only load failed"),
    ]
    for error, message in cases:
        assert run_reporting_errors("tool.py", raising(error)) == 2
        err = capsys.readouterr().err
        assert err.startswith("tool.py: error: ") and message in err, err
    for bug in (KeyError("loss_mask"), TypeError("unsupported operand")):
        with pytest.raises(type(bug)):
            run_reporting_errors("tool.py", raising(bug))
    assert run_reporting_errors("tool.py", lambda: None) == 0


def test_cli_exits_2_on_a_file_error(tmp_path, capsys):
    """An OSError inside a command (here: convert from a source folder that is a file) is a named error."""
    source = tmp_path / "file.txt"
    source.write_text("not a checkpoint")
    fails_cleanly(capsys, ["convert", str(source), str(tmp_path / "out"), "--to", "hub"], "convert", "file.txt")


@pytest.mark.parametrize(
    "option, value, fragment",
    [
        ("--block-size", "0", "block_size (--block-size) must be an integer >= 1, got 0"),
        ("--batch-size", "-1", "batch_size (--batch-size)"),
        ("--max-prompts", "0", "max_prompts (--max-prompts)"),
        ("--max-new-tokens", "4000", "max_new_tokens (4000) must be smaller than max_length"),
    ],
)
def test_prepare_data_checks_every_setting_before_any_work(tmp_path, monkeypatch, capsys, option, value, fragment):
    """Issue 25: `--block-size 0` was refused only after every reply had been regenerated."""
    prompts = write_lines(tmp_path / "mine.jsonl", [{"prompt": "Hello."}])

    def no_work(*args, **kwargs):
        raise AssertionError("a stage ran before the settings were checked")

    monkeypatch.setattr(pipeline, "load_target", no_work)
    monkeypatch.setattr(pipeline, "build_corpus", no_work)
    out = tmp_path / "out"
    argv = ["prepare-data", "--out", str(out), "--sources", "", "--prompts", str(prompts), option, value]
    fails_cleanly(capsys, argv, "prepare-data", fragment)
    assert not out.exists()


def test_bench_out_pointing_at_a_file_is_refused_before_the_benchmark(folders, tmp_path, capsys):
    """Issue 25: `bench --out FILE` ran the whole benchmark, then lost it to a FileExistsError."""
    target, drafter, prompts, _ = folders
    (tmp_path / "results").write_text("not a folder")
    argv = ["bench", "--prompts", str(prompts), "--target", "nope", "--drafter", "random"]
    fails_cleanly(capsys, [*argv, "--out", str(tmp_path / "results")], "bench", "--out", "is a file, not a folder")


def _no_model_loads(monkeypatch):
    """Make every model loader the writing commands use fail the test: refusals must come before them."""
    import hf_dflash.bench.command as bench_command
    import hf_dflash.bench.loading as bench_loading
    import hf_dflash.checkpoints.converting as converting
    import hf_dflash.checkpoints.publish as publish

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the output was checked")

    import transformers

    import hf_dflash.targets as targets

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loaded)
    for module, name in (
        (targets, "load_target"),
        (bench_command, "load_bench_models"),
        (bench_loading, "load_bench_models"),
        (converting, "load_drafter"),
        (publish, "load_drafter"),
    ):
        monkeypatch.setattr(module, name, loaded)


def writer_argv(command, folders, out):
    """The argv of `command` writing its result to `out`."""
    target, drafter, prompts, _ = folders
    tokenized = prompts.parent / "tokenized"  # what pack-data reads (prepare-data's, with its settings)
    if command == "pack-data":
        tokenized.mkdir(exist_ok=True)
        (tokenized / "config.json").write_text("{}")
    return {
        "export": ["export", str(drafter), str(out), "--target-id", "org/name"],
        "push": ["push", str(out), "--repo-id", "org/name"],
        "cache-features": ["cache-features", "--data", str(prompts.parent), "--out", str(out), "--target", "x"],
        "pack-data": ["pack-data", "--tokenized", str(tokenized), "--out", str(out), "--part", "p1"],
        "convert": ["convert", str(drafter), str(out), "--to", "official"],
        "bench": [
            "bench",
            "--prompts",
            str(prompts),
            "--target",
            str(target),
            "--drafter",
            "random",
            "--out",
            str(out),
        ],
        "generate": [
            "generate",
            "--prompts",
            str(prompts),
            "--target",
            str(target),
            "--drafter",
            "none",
            "--out",
            str(out),
        ],
    }[command]


@pytest.mark.parametrize(
    "command, output, lock, what",
    [
        ("export", "repo", "folder", "choose another folder for export"),
        ("push", "repo", "folder", "choose another folder for push"),
        ("cache-features", "features", "folder", "choose another folder for cache-features"),
        ("pack-data", "packed", "folder", "choose another folder for pack-data"),
        ("convert", "official", "beside", "choose another folder for convert"),
        ("bench", "bench", "folder", "choose another folder for bench --out"),
        ("generate", "answers.jsonl", "beside", "choose another file for generate --out"),
    ],
)
def test_a_second_writer_of_the_same_output_is_refused_before_any_work(
    folders, tmp_path, capsys, monkeypatch, command, output, lock, what
):
    """Issue 36: two exports into one folder, two `bench --out` to one folder, two `generate --out` to one file
    all exited 0 and one result was lost (and a push could upload a half-written export). The test holds the
    output's lock as a first run does; the command is refused by name, before any model loads."""
    from hf_dflash.folder_lock import folder_lock, lock_path_beside, path_lock

    out = tmp_path / output
    _no_model_loads(monkeypatch)
    holder = folder_lock(out) if lock == "folder" else path_lock(out)
    with holder:
        lock_file = out / ".hf-dflash.lock" if lock == "folder" else lock_path_beside(out)
        fails_cleanly(
            capsys,
            writer_argv(command, folders, out),
            command,
            f"another process is writing to {out}",
            str(lock_file),
            what,
        )
    assert not lock_file.exists()  # the refused run leaves the holder's lock alone; the holder removed it


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot create files in: a read-only one, or /sys for root (which ignores modes)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    folder = Path("/sys")
    try:
        os.close(os.open(folder / ".hf-dflash-probe", os.O_RDWR | os.O_CREAT, 0o644))
    except OSError:
        yield folder
    else:
        os.unlink(folder / ".hf-dflash-probe")
        pytest.skip("running as root, with no folder that refuses new files")


@pytest.mark.parametrize(
    "command, output",
    [
        ("bench", "bench"),
        ("generate", "answers.jsonl"),
        ("export", "repo"),
        ("cache-features", "features"),
        ("pack-data", "packed"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_any_model_loads(
    folders, unwritable, capsys, monkeypatch, command, output
):
    """Issue 36: `generate --out` and `bench --out` into a folder that cannot be written failed only after the
    models had loaded and every answer was generated."""
    _no_model_loads(monkeypatch)
    out = unwritable / output
    fails_cleanly(
        capsys, writer_argv(command, folders, out), command, f"{unwritable} cannot be written", "Nothing was loaded"
    )
    assert not out.exists()
