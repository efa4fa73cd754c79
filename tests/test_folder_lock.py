"""One writer per output folder (`hf_dflash.folder_lock`), across processes."""

import subprocess
import sys
import textwrap

import pytest

import hf_dflash.folder_lock as folder_lock_module
from hf_dflash.folder_lock import LOCK_NAME, FolderLockedError, folder_lock, lock_path_beside, path_lock


def test_a_second_holder_is_refused_and_the_lock_file_goes_with_the_first(tmp_path):
    out = tmp_path / "out"
    with folder_lock(out, "pack-data") as folder:
        assert folder == out and (out / LOCK_NAME).is_file()
        with pytest.raises(FolderLockedError) as caught:
            with folder_lock(out, "pack-data"):
                pass
        message = str(caught.value)
        assert f"another process is writing to {out}" in message and str(out / LOCK_NAME) in message
        assert "wait for it to finish or choose another folder for pack-data" in message
    assert not (out / LOCK_NAME).exists()
    (out / LOCK_NAME).write_text("pid 1")  # left by a killed holder: the file, but no lock
    with folder_lock(out):
        pass


def test_another_process_holding_the_lock_refuses_this_one(tmp_path):
    """A real second process (the module loaded from its file: no package import in the child)."""
    out = tmp_path / "out"
    child = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("folder_lock", {folder_lock_module.__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with module.folder_lock({str(out)!r}):
            print("locked", flush=True)
            sys.stdin.read()
        """
    )
    process = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "locked"
        with pytest.raises(FolderLockedError, match=rf"held by pid {process.pid}"):
            with folder_lock(out):
                pass
    finally:
        process.stdin.close()
        process.wait(timeout=30)
    with folder_lock(out):  # released with the process
        pass


@pytest.mark.parametrize("writer", ["regeneration", "cache-features", "prepare-data"])
def test_every_shared_folder_writer_refuses_a_second_one(tmp_path, writer):
    """Issue 25 B1 for the other writers: a locked folder is refused before anything is written into it."""
    from tests.helpers.data import PROMPTS, regenerate_tiny

    out = tmp_path / "out"
    with folder_lock(out):
        with pytest.raises(FolderLockedError, match="another process is writing to"):
            if writer == "regeneration":
                regenerate_tiny(out, PROMPTS[:2])
            elif writer == "cache-features":
                from hf_dflash.data.feature_cache import cache_features
                from tests.conftest import make_target
                from tests.helpers.features import write_tokenized

                cache_features(make_target("llama"), write_tokenized(tmp_path / "data"), out, [0, 1])
            else:
                from hf_dflash.data.pipeline import prepare_data

                prepare_data(out, sources=[], prompts_file=tmp_path / "none.jsonl")
        assert sorted(path.name for path in out.iterdir()) == [LOCK_NAME]


def test_a_single_output_file_is_locked_beside_it(tmp_path):
    """Issue 36: `generate --out FILE` (and `convert`, which replaces its folder whole) lock a file beside the
    output, in its folder (created)."""
    out = tmp_path / "new" / "answers.jsonl"
    with path_lock(out, "generate --out") as locked:
        assert locked == out and lock_path_beside(out) == tmp_path / "new" / ".answers.jsonl.hf-dflash.lock"
        assert lock_path_beside(out).is_file() and not out.exists()
        with pytest.raises(FolderLockedError, match=r"choose another file for generate --out"):
            with path_lock(out, "generate --out"):
                pass
        with path_lock(tmp_path / "new" / "other.jsonl"):  # another file of the same folder: its own lock
            pass
    assert sorted(path.name for path in (tmp_path / "new").iterdir()) == []


def test_a_waiting_holder_takes_the_lock_once_the_first_lets_go(tmp_path):
    """`path_lock(..., wait=True)` (a second `load_target` converting the same target) waits for the holder
    instead of refusing, then holds the lock itself."""
    import threading

    out = tmp_path / "smollm2"
    entered = threading.Event()

    def second():
        with path_lock(out, "converting", wait=True):
            entered.set()

    with path_lock(out, "converting"):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert not entered.wait(0.5)  # still held: the second holder waits
    assert entered.wait(30)
    waiter.join(30)
    assert not lock_path_beside(out).exists()


def test_folders_a_failed_holder_created_are_removed_when_empty(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError):
        with folder_lock(out):
            raise RuntimeError("the work failed")
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with folder_lock(tmp_path / "kept"):  # a folder that existed stays
            raise RuntimeError("the work failed")
    assert (tmp_path / "kept").is_dir()


def test_a_refused_train_ends_its_process_at_once(run_config):
    """Issue 53 item 4: `hf-dflash train` on a folder another process writes to prints the refusal and exits 2
    at once: the interpreter's teardown of the training libraries (2.5 s of CPU measured, tens of seconds on a
    loaded machine: the refused run seemed to hang) is skipped, so an atexit handler never runs."""
    import os
    import time

    import yaml

    output_dir = yaml.safe_load(run_config.read_text())["training"]["output_dir"]
    child = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('interpreter teardown ran', flush=True))\n"
        f"sys.argv = ['hf-dflash', 'train', '--config', {str(run_config)!r}]\n"
        "runpy.run_module('hf_dflash.cli', run_name='__main__')\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with folder_lock(output_dir, "training.output_dir"):
        process = subprocess.Popen(
            [sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
        )
        try:
            refusal = process.stderr.readline()
            refused_at = time.monotonic()
            status = process.wait(timeout=120)
            exited_after = time.monotonic() - refused_at
        finally:
            process.kill()
    assert "hf-dflash train: error: another process is writing to" in refusal, refusal + process.stderr.read()
    assert status == 2 and "interpreter teardown ran" not in process.stdout.read()
    assert exited_after < 2.0, f"the refused process ran {exited_after:.1f} s after its refusal"
