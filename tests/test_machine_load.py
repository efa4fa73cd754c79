"""Issue 53 item 11: `demo` and `bench` read the machine's load from /proc, warn when other processes make their
timings untrustworthy, and on a shared machine time a few thread counts and use the fastest."""

import json

import pytest
import torch

from hf_dflash import machine_load
from hf_dflash.cli import main
from hf_dflash.machine_load import MachineLoad, busy_processes, choose_threads, describe_load, read_machine_load
from tests.conftest import make_drafter, make_target
from tests.helpers.data import make_char_tokenizer, write_lines

SHARED = MachineLoad(4.2, 2, [("regenerate", 4242, 97.0), ("python3", 777, 55.0)])
QUIET = MachineLoad(0.3, 2, [])


def fake_proc(root, ticks: dict, loadavg: str = "3.50 2.00 1.00 3/200 999"):
    root.mkdir(exist_ok=True)
    (root / "loadavg").write_text(loadavg)
    for pid, (name, used) in ticks.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S"] + ["0"] * 10 + [str(used), "0"] + ["0"] * 30  # utime (field 14) = used, stime 0
        (root / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(fields))
    (root / "self").mkdir(exist_ok=True)  # not a pid: skipped
    return root


def test_busy_processes_are_read_from_two_proc_samples(tmp_path):
    before = machine_load._cpu_ticks(
        fake_proc(tmp_path / "a", {10: ("a (job) x", 100), 11: ("idle", 5), 12: ("me", 0)})
    )
    assert before[10] == ("a (job) x", 100)  # a name with spaces and brackets
    after = {10: ("a (job) x", 190), 11: ("idle", 6), 12: ("me", 500), 13: ("new", 50)}
    busy = busy_processes(before, after, seconds=1.0, ticks_per_second=100, own={12})
    assert busy == [("a (job) x", 10, 90.0)]  # idle (1%), ourselves and a process started in between are not listed
    load = read_machine_load(tmp_path / "a", seconds=0.01)
    assert load.load_average == 3.5 and load.usable_cores >= 1 and load.busy == []


def test_a_shared_machine_is_named_with_a_warning_and_the_advice():
    assert SHARED.shared and not QUIET.shared and MachineLoad(3.5, 2, []).shared  # load average >= cores + us
    text = describe_load(SHARED, machine_load.ThreadChoice(1, "a shared machine: the fastest measured", {1: 0.01}))
    assert "1-min load average 4.20 on 2 usable core(s)" in text and "regenerate (pid 4242, 97%)" in text
    assert "WARNING: other processes use 1.5 core(s) of 2: the timings below cannot be trusted" in text
    assert "OMP_WAIT_POLICY=PASSIVE" in text and "fewer threads" in text and "1: 10.0 ms" in text
    assert "WARNING" not in describe_load(QUIET, machine_load.ThreadChoice(2, "a quiet machine: the default"))
    record = SHARED.record()
    assert record["timings_trustworthy"] is False and record["other_busy_cores"] == 1.52
    assert record["other_busy_processes"][0] == {"name": "regenerate", "pid": 4242, "cpu_percent": 97.0}


def test_the_thread_count_is_measured_only_on_a_shared_machine():
    state = {"threads": 2}
    calls = []

    def run_once():  # the more threads, the slower: spinning OpenMP threads on cores others hold
        calls.append(state["threads"])
        total = sum(range(50000 * state["threads"] ** 3))
        assert total >= 0

    set_threads = lambda n: state.update(threads=n)  # noqa: E731
    choice = choose_threads(SHARED, run_once, 2, set_threads, environ={})
    assert choice.threads == 1 == state["threads"] and sorted(choice.seconds) == [1, 2]
    assert choice.seconds[1] < choice.seconds[2] and calls == [1, 1, 1, 1, 2]  # the slower count: one call
    calls.clear()
    assert choose_threads(QUIET, run_once, 2, set_threads, environ={}).threads == 2 and calls == []
    kept = choose_threads(SHARED, run_once, 2, set_threads, environ={"OMP_NUM_THREADS": "2"})
    assert (kept.threads, kept.reason, calls) == (2, "OMP_NUM_THREADS=2 is set: kept", [])


def test_bench_records_the_load_and_the_threads_in_its_json(tmp_path, capsys, monkeypatch):
    target = make_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    make_char_tokenizer().save_pretrained(tmp_path / "target")
    make_drafter(target, block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": "Hello there"}])
    monkeypatch.setattr(machine_load, "read_machine_load", lambda: SHARED)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    argv = ["bench", "--prompts", str(prompts), "--target", str(tmp_path / "target"), "--drafter",
            str(tmp_path / "drafter"), "--dtype", "float32", "--max-new-tokens", "4", "--methods", "plain,dflash",
            "--no-progress", "--out", str(tmp_path / "bench")]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    assert "WARNING: other processes use 1.5 core(s) of 2" in capsys.readouterr().out
    recorded = json.loads((tmp_path / "bench" / "bench.json").read_text())["machine_load"]
    assert recorded["timings_trustworthy"] is False and recorded["usable_cores"] == 2
    assert recorded["threads"]["reason"] == "a shared machine: the fastest measured" and recorded["threads"]["seconds"]
    assert torch.get_num_threads() == threads  # restored after the timings


@pytest.mark.real_model
def test_demo_prints_the_load(capsys, monkeypatch, real_target):
    from hf_dflash.demo import run_demo

    monkeypatch.setattr(machine_load, "read_machine_load", lambda: SHARED)
    run_demo(max_new_tokens=4, dtype="float32")
    assert "WARNING: other processes use 1.5 core(s) of 2" in capsys.readouterr().out
